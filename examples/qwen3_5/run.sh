#!/usr/bin/env bash
# Qwen3.5-MoE (Intern-S2 architecture) run: convert the HF checkpoint once, verify it, then train with
# torchrun on every node. Node count / addresses come from SLURM or env (see examples/paper/launch.sh):
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE.
#   sbatch -N 2 --gpus-per-node 8 examples/qwen3_5/run.sh examples/qwen3_5/qwen3_5_35b_a3b.yaml
#   SKIP_CONVERT=1 examples/qwen3_5/run.sh CONFIG.yaml train.steps=10     # extra args: key=value overrides
#   examples/qwen3_5/run.sh train CONFIG.yaml    # an s3ac-train subcommand first: default `pipeline` (coverage
#                                                # data -> value pretraining -> RL; docs/trainer.md "Pipeline")
# launch.sh starts (node 0) or joins (other nodes) the Ray cluster the SGLang engines run in, on every node before
# torchrun, and stops it at exit (RAY_PORT, RAY_ADDRESS: see examples/paper/launch.sh).
set -euo pipefail
CMD=pipeline
case "${1:-}" in pipeline|train|value-pretrain|demo) CMD=$1; shift ;; esac
CFG=${1:?usage: run.sh [pipeline|train|value-pretrain] CONFIG.yaml [key=value ...]}; shift
# The repository (where examples/paper/launch.sh is): S3AC_ROOT if set; else, under `sbatch` ($0 is then Slurm's
# spool copy of this script, not in the checkout), the submit directory; else this script's own checkout.
LAUNCH_REL=examples/paper/launch.sh
OWN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." 2>/dev/null && pwd || true)
if [ -n "${S3AC_ROOT:-}" ]; then
  [ -f "$S3AC_ROOT/$LAUNCH_REL" ] || { echo "run.sh: S3AC_ROOT=$S3AC_ROOT has no $LAUNCH_REL; set S3AC_ROOT to the" \
    "megatron_s3ac checkout" >&2; exit 2; }
elif [ -n "${SLURM_JOB_ID:-}" ] && [ ! -f "$OWN_ROOT/$LAUNCH_REL" ]; then  # a Slurm batch script's spool copy
  S3AC_ROOT=${SLURM_SUBMIT_DIR:-}
  [ -n "$S3AC_ROOT" ] && [ -f "$S3AC_ROOT/$LAUNCH_REL" ] || { echo "run.sh: running from Slurm's copy of the" \
    "script ($0) and the submit directory '${SLURM_SUBMIT_DIR:-}' has no $LAUNCH_REL: set S3AC_ROOT to the" \
    "megatron_s3ac checkout (on a filesystem every node sees), e.g. sbatch --export=ALL,S3AC_ROOT=/path/to/repo" >&2
    exit 2; }
else
  S3AC_ROOT=$OWN_ROOT
fi
export S3AC_ROOT
read -r HF MCORE < <(python - "$CFG" <<'PY'
import sys, yaml
m = yaml.safe_load(open(sys.argv[1]))["model"]
print(m["hf_config"], m["actor_init"])
PY
)
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
# Node 0 converts; started by hand on every node, the other nodes wait here for the converted checkpoint (every
# rank loads it: a filesystem all nodes see) before launch.sh joins Ray and torchrun, which would give up long
# before a large conversion ends (RAY_JOIN_TIMEOUT). CONVERT_WAIT_TIMEOUT (s, default 4 h), CONVERT_POLL_S.
CONVERT_WAIT_TIMEOUT=${CONVERT_WAIT_TIMEOUT:-14400}
CONVERT_POLL_S=${CONVERT_POLL_S:-10}
if [ -z "${SKIP_CONVERT:-}" ] && [ ! -e "$MCORE/.metadata" ]; then
  if [ "$NODE_RANK" = 0 ]; then
    python -m checkpoints_convert hf-to-mcore --hf "$HF" --out "$MCORE" --workers "${CONVERT_WORKERS:-16}"
  else
    echo "run.sh: node $NODE_RANK waits for node 0 to convert $HF into $MCORE (up to ${CONVERT_WAIT_TIMEOUT}s)" >&2
    deadline=$((SECONDS + CONVERT_WAIT_TIMEOUT))
    until [ -e "$MCORE/.metadata" ]; do
      [ $SECONDS -lt $deadline ] || { echo "run.sh: node $NODE_RANK: no converted checkpoint at $MCORE/.metadata" \
        "after ${CONVERT_WAIT_TIMEOUT}s (did node 0's conversion fail? is $MCORE on a filesystem every node sees?)" >&2
        exit 1; }
      sleep "$CONVERT_POLL_S"
    done
  fi
fi
exec bash "$S3AC_ROOT/$LAUNCH_REL" "$CMD" "$CFG" "$@"
