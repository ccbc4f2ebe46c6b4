"""megatron_s3ac: S3AC actor-critic RL for LLM reasoning on megatron-core."""
from setuptools import find_packages, setup

# Core pins. The exact CPU environment of CI and the demo (Python 3.12) is locked in requirements-cpu.txt (used as
# a constraints file by the Makefile). torch and transformers are ranges so the GPU extra resolves:
# the NGC image brings its own torch, and sglang 0.5.23 pins torch 2.14.1 / transformers 5.19.0.
CORE = [
    "torch>=2.6,<=2.14.1",
    "megatron-core==0.19.2",  # the only supported release, on Python 3.12 (docs/environment.md, "megatron-core")
    "transformers>=5.19.0,<=5.24.0",
    "safetensors==0.8.0",
    "ray[default]==2.60.0",
    "math-verify==0.9.0",
    "omegaconf==2.4.0",
    "tqdm==4.70.1",
    "tensorboard==2.21.0",
    "matplotlib==3.11.2",
    "pyarrow==26.0.1",
    "numpy>=1.26,<2.5",  # a range like torch: CPU lock 2.4.6 (requirements-cpu.txt); sglang's mistral-common needs <2.4 on py3.12
    "packaging>=24.2",  # megatron_s3ac.env and the megatron-core version gate (models.cpu_compat)
    "pyyaml==6.0.4",
    "requests==2.34.2",  # eval.judge: the LLM judge's OpenAI-compatible HTTP client (already in the CPU lock)
]
# GPU stack (Python 3.12, CUDA 13). Each pin and where it comes from: docs/environment.md. Checked with
# `pip install --dry-run --ignore-installed --no-build-isolation ".[gpu]"` on Python 3.12 (resolves);
# checked at start-up by megatron_s3ac/env.py (its MATRIX holds the same versions).
GPU = [
    "sglang==0.5.23",                       # the rollout engine wrapped by rollout/engines/sglang/engine.py
    "torch==2.14.1",                        # sglang 0.5.23 and sglang-kernel 0.4.10: Requires-Dist torch==2.14.1 (CUDA 13.0 wheel)
    "sglang-kernel==0.4.10",                # sglang 0.5.23: Requires-Dist sglang-kernel==0.4.10 (the `sgl_kernel` module)
    "flashinfer-python[cu13]==0.7.2",       # sglang 0.5.23: Requires-Dist flashinfer_python[cu13]==0.7.2
    "transformers==5.19.0",                 # sglang 0.5.23: Requires-Dist transformers==5.19.0
    "numpy<2.4",                            # mistral-common (sglang dep) on Python <=3.12: numpy<2.4
    # megatron-core 0.19.2: extra "te" = transformer-engine[pytorch,core_cu13], no range (METADATA);
    # its pyproject builds against TE git 27486e03 = "2.18.0+27486e03" (tool.uv.sources / dependency-metadata).
    # TE-torch is an sdist: build with --no-build-isolation (docs/environment.md)
    "transformer-engine[pytorch,core_cu13]==2.18.0",
    "flash-linear-attention[cuda]==0.6.0",  # Gated DeltaNet kernels; needs Triton >=3.7.1 on Hopper: torch 2.14.1 brings triton~=3.8.0
    "nvidia-modelopt==0.47.0",              # pure Python, torch>=2.8 (0.39.0 predates torch 2.14 by a year)
]
TEST = [
    "pytest==9.2.0",
    "pytest-timeout==2.4.0",
    "hypothesis==6.170.17",
    "accelerate==1.15.0",  # transformers refuses FP8 checkpoints without it (tests/fp8: dequantized load on CPU)
]

setup(
    name="megatron_s3ac",
    version="0.1.0",
    description="S3AC: stabilized, selective, scalable actor-critic RL on megatron-core",
    packages=find_packages(include=["megatron_s3ac", "megatron_s3ac.*", "checkpoints_convert", "checkpoints_convert.*"]),
    # megatron-core 0.19.2 needs 3.12 here (0.16.1, the last release for 3.11, was dropped). The vLLM engine's own
    # environment stays Python 3.11: it never installs this package (PYTHONPATH, rollout/engines/vllm/engine.py)
    python_requires=">=3.12",
    install_requires=CORE,
    extras_require={"gpu": GPU, "test": TEST, "wandb": ["wandb>=0.22,<0.23"]},
    entry_points={"console_scripts": [
        "s3ac-eval=megatron_s3ac.eval.cli:main",
        "s3ac-convert=checkpoints_convert:main",
        "s3ac-train=megatron_s3ac.trainer.cli:main",
        "s3ac-plan=megatron_s3ac.plan.cli:main",
        "s3ac-env=megatron_s3ac.env:main",
    ]},
)
