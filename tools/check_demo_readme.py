"""The README's demo figures are what the code prints: compare a demo run's table with the README's row.

    python tools/check_demo_readme.py [RUN_DIR] [--readme README.md] [--row "S3AC, fp32 (`make demo`)"] [--tol 1.0]

RUN_DIR (default runs/cpu_demo, where `make demo` writes) holds demo_result.json (the pass rates its table prints:
before / after, greedy / sampled). The README row whose first cell is ``--row`` holds the same four figures as
"before% -> after%" in its greedy and sampled cells. Exit 0 when each of the four is within ``--tol`` percentage
points, 1 naming every figure that is not (with both values), 2 when a file or the row is missing. `.ci/run` runs
it after `make demo`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

PAIR = re.compile(r"([\d.]+)%\s*->\s*([\d.]+)%")
ROW = "S3AC, fp32 (`make demo`)"


def readme_figures(readme: str, row: str) -> dict:
    """{(greedy|sampled, before|after): percent} of the README row whose first cell is ``row``."""
    for line in open(readme, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == row:
            got = [PAIR.search(c) for c in cells[1:3]]
            if len(cells) < 3 or not all(got):
                raise ValueError(f"{readme}: the row {row!r} does not hold 'before% -> after%' in its greedy and "
                                 f"sampled cells: {line.strip()}")
            return {(k, w): float(m.group(i + 1)) for k, m in zip(("greedy", "sampled"), got)
                    for i, w in enumerate(("before", "after"))}
    raise ValueError(f"{readme}: no table row whose first cell is {row!r}")


def run_figures(run_dir: str) -> dict:
    path = os.path.join(run_dir, "demo_result.json")
    try:
        res = json.load(open(path))
        return {(k, w): 100.0 * float(res[w][k]) for k in ("greedy", "sampled") for w in ("before", "after")}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a demo result ({type(err).__name__}: {err}); run `make demo` first") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", nargs="?", default="runs/cpu_demo")
    p.add_argument("--readme", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    "README.md"))
    p.add_argument("--row", default=ROW)
    p.add_argument("--tol", type=float, default=1.0, help="percentage points")
    a = p.parse_args(argv)
    try:
        want, got = readme_figures(a.readme, a.row), run_figures(a.run_dir)
    except ValueError as err:
        print(f"check_demo_readme: {err}", file=sys.stderr)
        return 2
    bad = [f"{k} {w}: README {want[k, w]:.1f}%, the run {got[k, w]:.1f}%" for (k, w) in want
           if abs(want[k, w] - got[k, w]) > a.tol]
    table = ", ".join(f"{k} {got[k, 'before']:.1f}% -> {got[k, 'after']:.1f}%" for k in ("greedy", "sampled"))
    if bad:
        print(f"check_demo_readme: the README's row {a.row!r} is not what {a.run_dir} printed ({table}); off by more "
              f"than {a.tol:g} points: " + "; ".join(bad), file=sys.stderr)
        return 1
    print(f"check_demo_readme: README matches {a.run_dir} within {a.tol:g} points ({table})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
