"""Rollout engines, one folder per engine kind with its weight sync and its registration (``<kind>/spec.py``, an
``EngineSpec`` in ``registry.py``): cpu/ (transformers, cpu and hf kinds), sglang/ (SGLangEngine, its settings, stage
broadcast and colocated IPC syncs), vllm/ (VLLMEngine, its server, worker extension, transfer wire and syncs);
remote.py: the generic Ray host (RemoteEngine); pool.py / ray_init.py: the Ray engine pool."""
