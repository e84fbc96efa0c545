"""Compare the training curves of runs with a reference curve at equal env steps.

    python benchmarks/compare_curves.py reference_runs/simple_spread_rmappo.csv RUN_DIR...

Prints a Markdown table: for each checkpoint step of the reference (every ``--every`` env steps),
the reference's training return and each run's training return (``train/episode_return`` in its
``metrics.csv``, linearly interpolated at that step), plus the mean over runs; and, for each run,
the wall time at which its greedy evaluation return first reached ``--target`` (if given).
"""

from __future__ import annotations

import argparse
import bisect
import csv
from pathlib import Path


def read_curve(path: Path, x: str, y: str) -> list[tuple[float, float]]:
    with path.open(encoding="utf-8", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(y) not in (None, "")]
    return [(float(r[x]), float(r[y])) for r in rows]


def interpolate(curve: list[tuple[float, float]], at: float) -> float | None:
    xs = [p[0] for p in curve]
    if not curve or at < xs[0] or at > xs[-1]:
        return None
    i = bisect.bisect_left(xs, at)
    if xs[i] == at:
        return curve[i][1]
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (at - x0) / (x1 - x0)


def first_reaching(run: Path, target: float) -> tuple[float, float] | None:
    """(env steps, wall seconds) of the first evaluation whose greedy return is >= target."""
    with (run / "metrics.csv").open(newline="") as f:
        for r in csv.DictReader(f):
            v = r.get("eval/eval_return_mean")
            if v not in (None, "") and float(v) >= target:
                return float(r["env_steps"]), float(r["wall_seconds"])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reference", type=Path)
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--every", type=float, default=250_000)
    p.add_argument("--target", type=float, default=None)
    args = p.parse_args()
    ref = read_curve(args.reference, "env_steps", "train_episode_return")
    runs = [read_curve(r / "metrics.csv", "env_steps", "train/episode_return") for r in args.runs]
    last = max(c[-1][0] for c in runs)
    header = ["env steps", "reference"] + [f"seed {i + 1}" for i in range(len(runs))] + ["mean"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    step = args.every
    while step <= min(last, ref[-1][0]):
        ys = [interpolate(c, step) for c in runs]
        got = [y for y in ys if y is not None]
        cells = [f"{step / 1e6:.2f}M", f"{interpolate(ref, step):.1f}"]
        cells += ["" if y is None else f"{y:.1f}" for y in ys]
        cells.append(f"{sum(got) / len(got):.1f}" if got else "")
        print("| " + " | ".join(cells) + " |")
        step += args.every
    if args.target is not None:
        for run in args.runs:
            hit = first_reaching(run, args.target)
            when = "not reached" if hit is None else f"{hit[0]:,.0f} steps, {hit[1]:.0f} s"
            print(f"- {run.name}: greedy return >= {args.target}: {when}")


if __name__ == "__main__":
    main()
