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

# ---- weight sync (plan/weight_sync.py): peak link rates per direction, and what a transfer achieves ------------
# NVIDIA H100 Tensor Core GPU datasheet (SXM): NVLink 900 GB/s per GPU, counted both ways -> 450 GB/s each way.
NVLINK_PEAK_GBPS = 450.0
# NVIDIA ConnectX-7 datasheet: 400 Gb/s NDR InfiniBand per port -> 50 GB/s each way.
NIC_PEAK_GBPS = 50.0
# NVIDIA DGX H100 user guide (and HGX H100 reference designs): eight single-port ConnectX-7 on the compute fabric,
# one on each GPU's PCIe switch. A GPU reaches other nodes through its own NIC: NCCL's PXN routes a remote send to
# the destination GPU's rail, so one GPU's inter-node traffic in either direction meets one NIC.
NICS_PER_NODE = 8
# achieved / peak for large (>= 100 MB) NCCL transfers (assumed; nccl-tests busbw on H100 nodes is commonly quoted at
# ~0.8-0.95 of these peaks; the low end is taken since a sync also pays kernel launches and stream syncs per bucket)
NVLINK_EFFICIENCY = 0.8
NIC_EFFICIENCY = 0.8
# engine side, per bucket: the controller's two round trips to every engine (check_weights, then
# update_weights_from_distributed, whose reply ends the bucket); a Ray call into the engine's HTTP server (assumed)
ENGINE_RPC_S = 0.002
# engine side, per HF tensor: the model's weight_loader (Python dispatch, narrow to the rank's shard, copy kernel
# launch), paid on every engine rank in parallel (assumed)
ENGINE_LOAD_S_PER_TENSOR = 20e-6

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
MAX_CP = 16  # largest context-parallel size the layout search tries (powers of two)
