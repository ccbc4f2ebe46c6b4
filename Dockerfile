# megatron_s3ac on GPUs: NGC PyTorch base + the pinned stack of setup.py.
# Build:  docker build -t megatron_s3ac .
# Run:    docker run --gpus all --ipc=host --network=host -v $PWD:/workspace/megatron_s3ac megatron_s3ac \
#           torchrun --nnodes=$NNODES --nproc_per_node=8 ... (see examples/)
FROM nvcr.io/nvidia/pytorch:25.09-py3

# The image ships torch and Transformer Engine; keep them (constraints below never replace torch).
ENV PIP_NO_CACHE_DIR=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_NVLS_ENABLE=0

WORKDIR /workspace/megatron_s3ac
COPY setup.py README.md ./
COPY megatron_s3ac ./megatron_s3ac
COPY checkpoints_convert ./checkpoints_convert

# Core deps at the versions of setup.py (megatron-core 0.16.1, ray 2.60.0, math-verify 0.9.0, ...).
RUN python -m pip install -e . && \
    python -c "import megatron.core, transformers, ray, math_verify; print('megatron-core', megatron.core.__version__)"

# GPU extras. sglang 0.5.23 pins its own torch/transformers; it runs in the rollout engines' Ray actors,
# installed without letting it replace the image's torch.
RUN python -m pip install --no-deps sglang==0.5.23 nvidia-modelopt==0.39.0 && \
    python -m pip install orjson psutil pybase64 msgspec pyzmq uvloop

COPY examples ./examples
COPY tools ./tools
