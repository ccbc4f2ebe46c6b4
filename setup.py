"""megatron_s3ac: S3AC actor-critic RL for LLM reasoning on megatron-core."""
from setuptools import find_packages, setup

# Core pins. The exact CPU environment of CI and the demo is locked in requirements-cpu.txt (used as
# a constraints file by the Makefile). torch and transformers are ranges so the GPU extra resolves:
# the NGC image brings its own torch, and sglang 0.5.23 pins torch 2.14.1 / transformers 5.19.0.
CORE = [
    "torch>=2.6,<=2.14.1",
    "megatron-core==0.16.1",
    "transformers>=5.19.0,<=5.24.0",
    "safetensors==0.8.0",
    "ray[default]==2.60.0",
    "math-verify==0.9.0",
    "omegaconf==2.4.0",
    "tqdm==4.70.1",
    "tensorboard==2.21.0",
    "matplotlib==3.11.2",
    "pyarrow==26.0.1",
    "numpy==2.4.6",
    "pyyaml==6.0.4",
]
GPU = [
    "transformer-engine[pytorch]==2.9.0",
    "sglang==0.5.23",
    "nvidia-modelopt==0.39.0",
]
TEST = [
    "pytest==9.2.0",
    "pytest-timeout==2.4.0",
    "hypothesis==6.170.17",
]

setup(
    name="megatron_s3ac",
    version="0.1.0",
    description="S3AC: stabilized, selective, scalable actor-critic RL on megatron-core",
    packages=find_packages(include=["megatron_s3ac", "megatron_s3ac.*", "checkpoints_convert", "checkpoints_convert.*"]),
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={"gpu": GPU, "test": TEST, "wandb": ["wandb>=0.22,<0.23"]},
    entry_points={"console_scripts": [
        "s3ac-eval=megatron_s3ac.eval.cli:main",
        "s3ac-convert=checkpoints_convert:main",
        "s3ac-train=megatron_s3ac.trainer.cli:main",
    ]},
)
