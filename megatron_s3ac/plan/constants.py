"""Every constant of the memory model, named, with its source (docs/planner.md repeats them).

Overheads are per GPU. Values marked "assumed" are first-principles guesses, to be replaced by the
figures ``tools/device_checks/plan_calibration.py`` prints on an H200; "measured" ones come from the
CPU calibration tests (tests/plan/test_calibration.py).
"""
GIB = 1024 ** 3

# ---- fixed overheads per GPU (assumed; typical H100/H200 figures) ----------------------------------
CUDA_CONTEXT_GIB = 0.75  # CUDA context + cuBLAS/cuDNN workspaces of one process
NCCL_GIB = 1.5  # NCCL communicator buffers of the TP/PP/DP/EP/EDP groups of actor and critic
FRAGMENTATION = 0.10  # caching-allocator fragmentation, as a fraction of the dynamic (activation) peak
WORKSPACE_GIB = 0.5  # transient per-layer workspaces (GEMM outputs before reduce-scatter, a2a buffers)

# ---- rollout engine (SGLang) ----------------------------------------------------------------------
ENGINE_CUDA_GRAPH_GIB = 2.0  # decode CUDA graphs + sampler buffers outside mem_fraction_static (assumed)
ENGINE_KV_BYTES = 2  # bf16 KV cache
ENGINE_SSM_STATE_BYTES = 4  # GDN recurrent state in fp32 (SGLang mamba cache default)
WEIGHT_SYNC_BUCKET_GIB = 1.0  # gathered-tensor staging buffer of the weight broadcast (one bucket)

# ---- host memory ------------------------------------------------------------------------------------
HOST_PROCESS_GIB_PER_GPU = 12.0  # trainer process RSS per GPU (torch, megatron, Ray, pinned staging)

# ---- activations -------------------------------------------------------------------------------------
GDN_CHUNK = 64  # chunk length of the chunked delta rule (fla and megatron's torch kernel)
MOE_IMBALANCE = 1.2  # expert-side tokens per rank / the balanced share when EP > 1 (no aux loss; assumed)
LOGIT_FP32_COPIES_TRAIN = 2  # fp32 masked copy of the logits + the softmax cross-entropy keeps (logprobs.py)
LOGIT_FP32_COPIES_FORWARD = 3  # forward-only: masked copy, exp(z - max), e*z of the entropy (logprobs.py)

# ---- ranking ----------------------------------------------------------------------------------------
SAFE_HEADROOM = 0.10  # a layout fits comfortably with this fraction of GPU (and host) memory to spare

# ---- throughput proxy --------------------------------------------------------------------------------
GPU_TFLOPS = 400.0  # sustained bf16 TFLOP/s per GPU (H200 ~ 40% of 989 dense peak; assumed)
NVLINK_GBPS = 350.0  # GB/s per GPU inside a node (assumed effective)
IB_GBPS = 40.0  # GB/s per GPU across nodes (400 Gb/s NIC per GPU, assumed effective)
HBM_TBPS = 4.8  # H200 HBM3e TB/s per GPU (sync-vs-async step-time proxy: memory-bound decode; plan.async_time)
HBM_EFFICIENCY = 0.5  # fraction of HBM bandwidth a decode step sustains (assumed)

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
MAX_CP = 16  # largest context-parallel size the layout search tries (powers of two)
