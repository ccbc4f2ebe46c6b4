"""Draw paper-style curves from a run directory: python tools/plot_curves.py runs/cpu_demo [--out DIR]."""
import argparse

from megatron_s3ac.trainer.run.plotting import plot_run

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    args = ap.parse_args()
    for p in plot_run(args.run_dir, args.out):
        print(p)
