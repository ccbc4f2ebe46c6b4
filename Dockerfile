# megatron_s3ac on GPUs: CUDA 13 devel base + Python 3.12 venv + the pinned `gpu` stack of setup.py.
#
# NOT BUILT: no machine in this project can build or run it. What it was checked against (2026-11-30):
#   * the resolver: on Python 3.12, `pip install --dry-run --ignore-installed --no-build-isolation ".[gpu]"`
#     with torch 2.14.1 installed resolves (command and output summary: docs/environment.md);
#   * the wheels' METADATA (Requires-Dist): sglang 0.5.23 and sglang-kernel 0.4.10 pin torch==2.14.1
#     (a PyPI CUDA 13.0 wheel: cuda-toolkit 13.0.3, cuDNN 9.24, NCCL 2.30.7, triton~=3.8.0);
#     transformer-engine-torch is an sdist whose setup.py compiles against the torch it finds and then
#     requires transformer_engine_cu<torch's CUDA major>.
# Why not an NGC PyTorch base: NGC torch is a source build ("2.x.0a0+...nv"), which never satisfies
# sglang's `torch==2.14.1`; pip would replace it, and the image's Transformer Engine / apex, compiled
# against the replaced torch, would then fail to load. Installing sglang with --no-deps instead (the
# old Dockerfile) leaves its kernels (sglang-kernel, flashinfer, ...) missing. Peers that combine SGLang
# and Megatron (slime) start from SGLang's torch and compile TE against it with --no-build-isolation;
# this file does the same from PyPI wheels only. `s3ac-env` at the end refuses a stack that disagrees.
#
# Build:  docker build -t megatron_s3ac .
# Check:  docker run --gpus all --rm megatron_s3ac s3ac-env
# Run:    docker run --gpus all --ipc=host --network=host --shm-size=16g -v $PWD/runs:/workspace/runs \
#           megatron_s3ac torchrun --nnodes=$NNODES --nproc_per_node=8 -m megatron_s3ac.trainer.cli train CONFIG.yaml

# CUDA 13.0 devel: nvcc matching torch 2.14.1's CUDA major (TE's build asserts 12 or 13 and links the
# torch CUDA runtime; flashinfer / TE / Triton JIT need nvcc and headers at run time too).
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04

# ---- base: Python 3.12 venv with the exact torch ---------------------------------------------------
FROM ${CUDA_DEVEL_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# Ubuntu 24.04's python3 is 3.12 (megatron-core 0.17+ and sglang's cp312 wheel need it; the GPU path
# is on 3.12). git: pip installs from a checkout; numactl/rdma libs: NCCL across nodes.
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev git build-essential ninja-build cmake \
        libibverbs1 librdmacm1 ibverbs-providers numactl ca-certificates && \
    rm -rf /var/lib/apt/lists/* && \
    python3.12 -m venv $VIRTUAL_ENV && \
    pip install --upgrade "pip>=25" "setuptools>=77" wheel
# torch first, from the same index the resolver used: everything compiled later builds against it.
RUN pip install "torch==2.14.1" && \
    python -c "import torch; assert torch.__version__.split('+')[0] == '2.14.1', torch.__version__; print(torch.__version__, torch.version.cuda)"

# ---- te-build: Transformer Engine's torch extension, compiled against that torch -------------------
# transformer-engine-torch is an sdist: a C++ torch extension (torch.utils.cpp_extension.CppExtension)
# over TE's common headers; the CUDA kernels come prebuilt in transformer_engine_cu13. It is bound to
# the C++ ABI of the torch it is compiled with, hence --no-build-isolation (build isolation would
# compile it against the newest torch on the index, 2.15.0 today, not 2.14.1).
FROM base AS te-build
ARG MAX_JOBS=16
# FORCE_BUILD: compile here rather than let TE's setup.py fetch a prebuilt wheel matched by name only.
ENV NVTE_FRAMEWORK=pytorch \
    NVTE_PYTORCH_FORCE_BUILD=TRUE \
    MAX_JOBS=${MAX_JOBS}
RUN pip install pybind11 ninja && \
    pip wheel --no-build-isolation --no-deps -w /wheels "transformer-engine-torch==2.11.0"

# ---- final: the package with its `gpu` extra, TE from the wheel built above ------------------------
FROM base AS final
COPY --from=te-build /wheels /wheels
WORKDIR /workspace/megatron_s3ac
COPY setup.py README.md ./
COPY megatron_s3ac ./megatron_s3ac
COPY checkpoints_convert ./checkpoints_convert
# --no-build-isolation: nothing gets compiled against a different torch in a throw-away build env;
# --only-binary for TE-torch: it must come from /wheels (built against this image's torch), never the sdist.
RUN pip install --no-build-isolation --find-links /wheels --only-binary transformer-engine-torch \
        -e ".[gpu]" && \
    rm -rf /wheels && \
    python -c "import torch; assert torch.__version__.split('+')[0] == '2.14.1', 'torch was replaced: ' + torch.__version__"
# The version matrix, checked without a GPU (the build has none): exits non-zero on a known-bad combination.
RUN s3ac-env --no-gpu

ENV CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_NVLS_ENABLE=0
COPY examples ./examples
COPY tools ./tools
