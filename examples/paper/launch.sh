#!/usr/bin/env bash
# Multi-node launcher for the paper settings. Node count / addresses / GPUs come from SLURM or env:
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE (defaults: SLURM_* or 1 node, all GPUs).
#   sbatch -N 4 --gpus-per-node 8 examples/paper/launch.sh examples/paper/qwen25_math_1p5b_k16.yaml
set -euo pipefail
CFG=${1:?usage: launch.sh CONFIG.yaml [key=value ...]}; shift
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n1 || echo localhost)}
MASTER_PORT=${MASTER_PORT:-29500}
LAUNCH="torchrun --nnodes $NNODES --node-rank $NODE_RANK --nproc-per-node $GPUS_PER_NODE \
  --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT -m megatron_s3ac.trainer.cli train $CFG $*"
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SLURM_PROCID_SET:-}" ]; then
  export SLURM_PROCID_SET=1
  srun --ntasks-per-node 1 bash -c "NODE_RANK=\$SLURM_NODEID $LAUNCH"
else
  exec $LAUNCH
fi
