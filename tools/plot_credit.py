"""The credit plot (paper Figure 2b style) from runs' ``credit.jsonl`` (``train.credit_every``).

    python tools/plot_credit.py --run S3AC runs/claims/runs/s3ac/seed1 runs/claims/runs/s3ac/seed2 \
        --run GRPO-X runs/claims/runs/grpo_x/seed1 runs/claims/runs/grpo_x/seed2 --out credit.png

Each ``--run LABEL DIR...`` is one panel, its seeds pooled: mean advantage by response progress for
correct and incorrect responses on easy and hard prompts (megatron_s3ac/eval/credit.py). Prints the
curves as JSON (also OUT with .json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_s3ac.eval.credit import credit_curves, plot_credit, read_credit  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", nargs="+", action="append", required=True, metavar=("LABEL", "DIR"))
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--bins", type=int, default=10)
    args = p.parse_args(argv)
    panels = {}
    for label, *dirs in args.run:
        rows = []
        for d in dirs:
            path = os.path.join(d, "credit.jsonl")
            if not os.path.exists(path):
                print(f"plot_credit: {path} does not exist (run with train.credit_every >= 1)", file=sys.stderr)
                return 2
            rows += read_credit(path)
        panels[label] = credit_curves(rows, args.bins)
    plot_credit(panels, args.out)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(panels, f, indent=1)
    print(json.dumps({k: v["mean"] for k, v in panels.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
