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
HERE=$(cd "$(dirname "$0")" && pwd)
read -r HF MCORE < <(python - "$CFG" <<'PY'
import sys, yaml
m = yaml.safe_load(open(sys.argv[1]))["model"]
print(m["hf_config"], m["actor_init"])
PY
)
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [ -z "${SKIP_CONVERT:-}" ] && [ "$NODE_RANK" = 0 ] && [ ! -e "$MCORE/.metadata" ]; then
  python -m checkpoints_convert hf-to-mcore --hf "$HF" --out "$MCORE" --workers "${CONVERT_WORKERS:-16}"
fi
exec "$HERE/../paper/launch.sh" "$CMD" "$CFG" "$@"
