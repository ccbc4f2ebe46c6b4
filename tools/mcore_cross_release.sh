#!/bin/bash
# Cross-release checks between two venvs (default: .venv311 = megatron-core 0.16.1 / Python 3.11, .venv = 0.19.2 / 3.12),
# as run for docs/environment.md ("megatron-core"):
#   1. tiny Qwen2 / Qwen3 / Qwen3-MoE / Qwen3.5-MoE text / VL HF checkpoints converted by OLD, `s3ac-convert verify`
#      by NEW at tp1, tp2, pp2, ep2 (MoE), cp2 (verify's default tolerance: atol 1e-4, top-1 100%);
#   2. 3 RL steps of examples/cpu_demo.yaml on OLD (saving at step 2) and on NEW, compared with tools/compare_metrics.py;
#   3. OLD's step-2 trainer checkpoint (weights + optimizer) resumed by NEW for step 2, compared with OLD's run.
# usage: tools/mcore_cross_release.sh [OLD_VENV] [NEW_VENV] [WORK_DIR]     (~15 min on 2 cores)
set -u -o pipefail
cd "$(dirname "$0")/.."
OLD=${1:-.venv311}; NEW=${2:-.venv}; W=${3:-/tmp/s3ac_cross_release}
rm -rf "$W" && mkdir -p "$W"
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ver() { "$1/bin/python" -c "import sys; from megatron_s3ac.models.cpu_compat import megatron_core_version as v; print('megatron-core', v(), 'python', sys.version.split()[0])" 2>/dev/null; }
echo "old: $(ver "$OLD")"; echo "new: $(ver "$NEW")"
"$OLD/bin/python" - "$W" <<'PY' 2>/dev/null | grep -v Writing
import sys
from megatron_s3ac.convert.hf_to_mcore import hf_to_mcore
from megatron_s3ac.models.tiny_models import save_tiny_hf
from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5
if __name__ == "__main__":
    w = sys.argv[1]
    hf = {"qwen2": save_tiny_hf("qwen2", f"{w}/hf/qwen2", seed=0), "qwen3": save_tiny_hf("qwen3", f"{w}/hf/qwen3", seed=1),
          "qwen3_moe": save_tiny_hf("qwen3_moe", f"{w}/hf/qwen3_moe", seed=2),
          "q35_text": save_tiny_qwen3_5(f"{w}/hf/q35_text", "text", "fused", seed=3),
          "q35_vl": save_tiny_qwen3_5(f"{w}/hf/q35_vl", "vl", "fused", seed=4)}
    for name, d in hf.items():
        hf_to_mcore(d, f"{w}/mcore/{name}", workers=1, progress=False)
PY
fail=0
for m in qwen2 qwen3 qwen3_moe q35_text q35_vl; do
  for lay in "" "--tp 2" "--pp 2" "--ep 2" "--cp 2"; do
    case "$m:$lay" in qwen2:--ep*|qwen3:--ep*) continue;; esac
    out=$("$NEW/bin/s3ac-convert" verify --hf "$W/hf/$m" --mcore "$W/mcore/$m" $lay 2>&1); rc=$?
    [ $rc = 0 ] || fail=1
    echo "$m [${lay:-tp1}] rc=$rc $(echo "$out" | grep '^verify' | tail -1)"
  done
done
common="examples/cpu_demo.yaml train.steps=3 train.eval_every=0 train.progress=false train.tensorboard=false"
train() { local venv=$1 out=$2; shift 2
  "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_s3ac.trainer.cli train \
    $common train.out_dir="$out" "$@" > "$out.log" 2>&1 || { echo "train $out failed: $out.log"; fail=1; }; }
train "$OLD" "$W/old" train.save_every=2
train "$NEW" "$W/new"
cp -r "$W/old" "$W/resumed" && train "$NEW" "$W/resumed"
grep -h "resumed from" "$W/resumed.log" | head -1
for b in new resumed; do
  echo "== old vs $b, exact:"; "$OLD/bin/python" tools/compare_metrics.py "$W/old" "$W/$b" | tail -3
  echo "== old vs $b, --rel 1e-5 --logprob-diffs:"
  "$OLD/bin/python" tools/compare_metrics.py "$W/old" "$W/$b" --rel 1e-5 --logprob-diffs | tail -1 || fail=1
done
exit $fail
