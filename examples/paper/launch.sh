#!/usr/bin/env bash
# Multi-node launcher for the paper settings. Node count / addresses / GPUs come from SLURM or env:
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE (defaults: SLURM_* or 1 node, all GPUs),
#   TRAINER_GPUS_PER_NODE (rollout.placement: separate; default GPUS_PER_NODE, see below).
#   S3AC_ROOT: the checkout (default: this script's, or SLURM_SUBMIT_DIR under sbatch: submit from the repo root).
#   sbatch -N 4 --gpus-per-node 8 examples/paper/launch.sh [SUBCOMMAND] examples/paper/qwen25_math_1p5b_k16.yaml [key=value ...]
# SUBCOMMAND: an s3ac-train subcommand, default `pipeline` (coverage data -> value pretraining -> RL, each stage
# resumable; docs/trainer.md "Pipeline"); `train` runs RL alone (set model.critic_init for S3AC), `value-pretrain`.
# Ray (the SGLang rollout engines are Ray actors, docs/rollout.md): on every node, before torchrun, node 0 starts
# the Ray head (RAY_PORT, default 6379) and the other nodes join it; RAY_ADDRESS is exported so the trainer
# connects (ray.init(address="auto")) instead of starting a local Ray. Each node stops its Ray at exit (also on
# failure or Ctrl-C). With RAY_ADDRESS already set (an existing cluster), nothing is started or stopped (a cluster
# with token authentication then needs RAY_AUTH_MODE=token too).
set -euo pipefail
# The repository: S3AC_ROOT if set; else, under `sbatch` ($0 is then Slurm's spool copy of this script, which exists
# on the first node only), the submit directory; else this script's own checkout. Every node runs the repo's copy.
SELF_REL=examples/paper/launch.sh
OWN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." 2>/dev/null && pwd || true)
if [ -n "${S3AC_ROOT:-}" ]; then
  [ -f "$S3AC_ROOT/$SELF_REL" ] || { echo "launch.sh: S3AC_ROOT=$S3AC_ROOT has no $SELF_REL; set S3AC_ROOT to the" \
    "megatron_s3ac checkout" >&2; exit 2; }
elif [ -n "${SLURM_JOB_ID:-}" ] && [ ! -f "$OWN_ROOT/$SELF_REL" ]; then  # a Slurm batch script's spool copy
  S3AC_ROOT=${SLURM_SUBMIT_DIR:-}
  [ -n "$S3AC_ROOT" ] && [ -f "$S3AC_ROOT/$SELF_REL" ] || { echo "launch.sh: running from Slurm's copy of the" \
    "script ($0) and the submit directory '${SLURM_SUBMIT_DIR:-}' has no $SELF_REL: set S3AC_ROOT to the" \
    "megatron_s3ac checkout (on a filesystem every node sees), e.g. sbatch --export=ALL,S3AC_ROOT=/path/to/repo" >&2
    exit 2; }
else
  S3AC_ROOT=$OWN_ROOT
fi
export S3AC_ROOT
CMD=pipeline
case "${1:-}" in pipeline|train|value-pretrain|demo) CMD=$1; shift ;; esac
CFG=${1:?usage: launch.sh [pipeline|train|value-pretrain] CONFIG.yaml [key=value ...]}; shift
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
# The GPUs this process and its children (torchrun's ranks, Ray, vLLM's servers) can use: CUDA_VISIBLE_DEVICES when
# set (Slurm sets it for each step's tasks from their GPU allocation: srun --gpus-per-task / --gpu-bind / a step given
# part of the node), else every GPU of the node. nvidia-smi (NVML) ignores CUDA_VISIBLE_DEVICES, so its count is the
# node's, not this task's: it is used only when nothing narrows the view.
VISIBLE_GPUS=
[ -z "${CUDA_VISIBLE_DEVICES+x}" ] || VISIBLE_GPUS=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true)
if [ -z "${GPUS_PER_NODE:-}" ]; then  # count "GPU i: ..." lines; no nvidia-smi (or no GPU) -> say what to set
  if [ -n "$VISIBLE_GPUS" ]; then
    GPUS_PER_NODE=$VISIBLE_GPUS
  else
    GPUS_PER_NODE=$( { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU ' || true)
  fi
  if [ "${GPUS_PER_NODE:-0}" -lt 1 ]; then
    echo "launch.sh: cannot count this node's GPUs (nvidia-smi -L is missing or lists none, or" \
      "CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-}' lists none); set GPUS_PER_NODE to the number of GPUs per" \
      "node, e.g. GPUS_PER_NODE=8" >&2
    exit 2
  fi
fi
# Under sbatch the batch step counts once and the srun tasks below inherit GPUS_PER_NODE: each node's task must
# see that many (torchrun's rank r takes cuda:r, Ray refuses --num-gpus above its visible devices:
# ray/_private/resource_and_label_spec.py _resolve_accelerator_resources).
if [ -n "$VISIBLE_GPUS" ] && [ "$VISIBLE_GPUS" -ne "$GPUS_PER_NODE" ]; then
  echo "launch.sh: GPUS_PER_NODE=$GPUS_PER_NODE, but this task sees $VISIBLE_GPUS GPU(s)" \
    "(CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES${SLURM_JOB_ID:+, set by Slurm for this task of the step}): torchrun's" \
    "ranks and Ray can use only those. Give the one task per node every GPU of its node (sbatch --gpus-per-node=G" \
    "--ntasks-per-node=1, without --gpus-per-task / --gpu-bind narrowing it) or set GPUS_PER_NODE=$VISIBLE_GPUS" >&2
  exit 2
fi
# rollout.placement: separate (the engines on GPUs of their own): TRAINER_GPUS_PER_NODE of each node's GPUs run the
# trainer's ranks (torchrun; rank r uses cuda:LOCAL_RANK, the first ones), the rest go to Ray for the engine actors
# (`ray start` under CUDA_VISIBLE_DEVICES of those GPUs: Ray maps its slots through the raylet's list,
# ray/_private/worker.py get_accelerator_ids_for_accelerator_resource) and to vLLM's servers (rollout/engines/vllm:
# engine_devices, after LOCAL_WORLD_SIZE). Default: every GPU to both (colocated: the engines sleep while it trains).
TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
if ! [ "$TRAINER_GPUS_PER_NODE" -ge 1 ] 2>/dev/null || [ "$TRAINER_GPUS_PER_NODE" -gt "$GPUS_PER_NODE" ]; then
  echo "launch.sh: TRAINER_GPUS_PER_NODE=$TRAINER_GPUS_PER_NODE must be 1..GPUS_PER_NODE ($GPUS_PER_NODE)" >&2
  exit 2
fi
NODE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS_PER_NODE - 1)))}
ENGINE_DEVICES=$(echo "$NODE_DEVICES" | cut -d, -f$((TRAINER_GPUS_PER_NODE + 1))- -s)
[ "$TRAINER_GPUS_PER_NODE" -lt "$GPUS_PER_NODE" ] || ENGINE_DEVICES=$NODE_DEVICES
RAY_GPUS=$GPUS_PER_NODE
[ "$TRAINER_GPUS_PER_NODE" -eq "$GPUS_PER_NODE" ] || RAY_GPUS=$((GPUS_PER_NODE - TRAINER_GPUS_PER_NODE))
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n1 || echo localhost)}
MASTER_PORT=${MASTER_PORT:-29500}
RAY_PORT=${RAY_PORT:-6379}
RAY_JOIN_TIMEOUT=${RAY_JOIN_TIMEOUT:-300}
export NNODES GPUS_PER_NODE TRAINER_GPUS_PER_NODE MASTER_ADDR MASTER_PORT RAY_PORT RAY_JOIN_TIMEOUT
# The Qwen2.5-Math examples serve 2,048 + 16,384 tokens (rollout.sglang.context_length 18432) on a model whose
# config says 4,096 positions; sglang 0.5.23 accepts a longer context only with this set in the engines'
# environment (sglang/srt/configs/model_config.py:1303-1315). Ray actors inherit it from the driver.
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=${SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN:-1}
# Gloo (megatron-core's gloo groups, the trainer's rank-0 wait group: trainer/step/rank0.py) listens on the address
# this host's name resolves to when that address binds (torch ProcessGroupGloo createDefaultDevice /
# doesHostnameResolveToUsableAddress), a loopback one included: on a host whose /etc/hosts maps its name to 127.0.1.1
# (stock Debian/Ubuntu) the other nodes are told a loopback address and cannot connect. There, unless
# GLOO_SOCKET_IFNAME is set, gloo gets the interface of this host's default route.
if [ "$NNODES" -gt 1 ] && [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
  HOST_ADDR=$(getent ahostsv4 "$(hostname)" 2>/dev/null | awk 'NR == 1 {print $1}' || true)
  case "$HOST_ADDR" in
    127.*|"")
      GLOO_IF=$( { ip -o -4 route show to default 2>/dev/null || true; } |
        awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')
      if [ -n "$GLOO_IF" ]; then
        export GLOO_SOCKET_IFNAME=$GLOO_IF
        echo "launch.sh: $(hostname) resolves to '${HOST_ADDR:-nothing}': GLOO_SOCKET_IFNAME=$GLOO_IF (default route)"
      else
        echo "launch.sh: $(hostname) resolves to '${HOST_ADDR:-nothing}' and there is no default route: set" \
          "GLOO_SOCKET_IFNAME to the interface the nodes reach each other on" >&2
      fi ;;
  esac
fi
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SLURM_PROCID_SET:-}" ]; then
  export SLURM_PROCID_SET=1
  # one task per node runs this script again (the branch below): Ray + torchrun on every node
  # (the repository's copy: Slurm's spool copy, $0 under sbatch, is on the first node only)
  exec srun --ntasks-per-node 1 bash -c 'NODE_RANK=$SLURM_NODEID exec bash "$0" "$@"' "$S3AC_ROOT/$SELF_REL" \
    "$CMD" "$CFG" "$@"
fi

ray_up() {  # start (node 0) or join (others) the job's Ray cluster; stop it at exit
  if [ -n "${RAY_ADDRESS:-}" ]; then echo "launch.sh: using the Ray cluster at $RAY_ADDRESS"; return; fi
  trap 'ray stop --force >/dev/null 2>&1 || true' EXIT INT TERM
  # Ray 2.60: `ray start` turns token auth on when a token exists (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
  # ~/.ray/auth_token, which any local ray.init() writes), but a driver given RAY_ADDRESS never does (it then fails
  # with "Authentication token is missing"): decide once, here, for Ray on every node and for the trainer
  if [ -z "${RAY_AUTH_MODE:-}" ]; then
    RAY_AUTH_MODE=disabled
    if [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; then RAY_AUTH_MODE=token; fi
    export RAY_AUTH_MODE
  fi
  if [ "$NODE_RANK" = 0 ]; then
    CUDA_VISIBLE_DEVICES=$ENGINE_DEVICES ray start --head --port "$RAY_PORT" --num-gpus "$RAY_GPUS" \
      --disable-usage-stats --include-dashboard false
  else
    local deadline=$((SECONDS + RAY_JOIN_TIMEOUT))
    until CUDA_VISIBLE_DEVICES=$ENGINE_DEVICES ray start --address "$MASTER_ADDR:$RAY_PORT" --num-gpus "$RAY_GPUS" \
        --disable-usage-stats; do
      [ $SECONDS -lt $deadline ] || { echo "launch.sh: node $NODE_RANK could not join Ray at $MASTER_ADDR:$RAY_PORT" \
        "within ${RAY_JOIN_TIMEOUT}s" >&2; exit 1; }
      sleep 5
    done
  fi
  export RAY_ADDRESS="$MASTER_ADDR:$RAY_PORT"
}

ray_up
# not exec: the EXIT trap must run after torchrun to stop this node's Ray
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$TRAINER_GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" -m megatron_s3ac.trainer.cli "$CMD" "$CFG" "$@"
