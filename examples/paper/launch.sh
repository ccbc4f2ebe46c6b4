#!/usr/bin/env bash
# Multi-node launcher for the paper settings. Node count / addresses / GPUs come from SLURM or env:
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE (defaults: SLURM_* or 1 node, all GPUs).
#   sbatch -N 4 --gpus-per-node 8 examples/paper/launch.sh [SUBCOMMAND] examples/paper/qwen25_math_1p5b_k16.yaml [key=value ...]
# SUBCOMMAND: an s3ac-train subcommand, default `pipeline` (coverage data -> value pretraining -> RL, each stage
# resumable; docs/trainer.md "Pipeline"); `train` runs RL alone (set model.critic_init for S3AC), `value-pretrain`.
# Ray (the SGLang rollout engines are Ray actors, docs/rollout.md): on every node, before torchrun, node 0 starts
# the Ray head (RAY_PORT, default 6379) and the other nodes join it; RAY_ADDRESS is exported so the trainer
# connects (ray.init(address="auto")) instead of starting a local Ray. Each node stops its Ray at exit (also on
# failure or Ctrl-C). With RAY_ADDRESS already set (an existing cluster), nothing is started or stopped.
set -euo pipefail
CMD=pipeline
case "${1:-}" in pipeline|train|value-pretrain|demo) CMD=$1; shift ;; esac
CFG=${1:?usage: launch.sh [pipeline|train|value-pretrain] CONFIG.yaml [key=value ...]}; shift
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n1 || echo localhost)}
MASTER_PORT=${MASTER_PORT:-29500}
RAY_PORT=${RAY_PORT:-6379}
RAY_JOIN_TIMEOUT=${RAY_JOIN_TIMEOUT:-300}
export NNODES GPUS_PER_NODE MASTER_ADDR MASTER_PORT RAY_PORT RAY_JOIN_TIMEOUT
# The Qwen2.5-Math examples serve 2,048 + 16,384 tokens (rollout.sglang.context_length 18432) on a model whose
# config says 4,096 positions; sglang 0.5.23 accepts a longer context only with this set in the engines'
# environment (sglang/srt/configs/model_config.py:1303-1315). Ray actors inherit it from the driver.
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=${SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN:-1}
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SLURM_PROCID_SET:-}" ]; then
  export SLURM_PROCID_SET=1
  # one task per node runs this script again (the branch below): Ray + torchrun on every node
  exec srun --ntasks-per-node 1 bash -c "NODE_RANK=\$SLURM_NODEID exec \"$0\" \"\$@\"" bash "$CMD" "$CFG" "$@"
fi

ray_up() {  # start (node 0) or join (others) the job's Ray cluster; stop it at exit
  if [ -n "${RAY_ADDRESS:-}" ]; then echo "launch.sh: using the Ray cluster at $RAY_ADDRESS"; return; fi
  trap 'ray stop --force >/dev/null 2>&1 || true' EXIT INT TERM
  if [ "$NODE_RANK" = 0 ]; then
    ray start --head --port "$RAY_PORT" --num-gpus "$GPUS_PER_NODE" --disable-usage-stats --include-dashboard false
  else
    local deadline=$((SECONDS + RAY_JOIN_TIMEOUT))
    until ray start --address "$MASTER_ADDR:$RAY_PORT" --num-gpus "$GPUS_PER_NODE" --disable-usage-stats; do
      [ $SECONDS -lt $deadline ] || { echo "launch.sh: node $NODE_RANK could not join Ray at $MASTER_ADDR:$RAY_PORT" \
        "within ${RAY_JOIN_TIMEOUT}s" >&2; exit 1; }
      sleep 5
    done
  fi
  export RAY_ADDRESS="$MASTER_ADDR:$RAY_PORT"
}

ray_up
# not exec: the EXIT trap must run after torchrun to stop this node's Ray
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" -m megatron_s3ac.trainer.cli "$CMD" "$CFG" "$@"
