"""Rollout engines, one folder per engine kind with its weight sync: cpu/ (transformers, in process or a
Ray actor), sglang/ (SGLangEngine, its stage broadcast and colocated IPC syncs), vllm/ (VLLMEngine, its server,
worker extension, transfer wire and syncs); pool.py / ray_init.py: the Ray engine pool."""
