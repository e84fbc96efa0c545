"""One Markdown table row per training run, from each run's ``metrics.csv``.

    python benchmarks/run_table.py runs/smac/2s3z/mappo/*                     # win rates
    python benchmarks/run_table.py --metric eval/eval_return_mean --scale 2 \\
        runs/gymnasium/lbforaging/Foraging-8x8-2p-2f-v3/rmappo/*            # LBF team returns

Columns: task, seed, env steps, wall seconds, the first evaluation at or above ``--threshold``
(env steps and wall time then; only with a threshold), the best evaluation and where it was, the
final evaluation, the median of the last ``--last-evals`` evaluations (the per-seed score of the
MAPPO paper, which takes the median of the final ten), and the mean training return over the last
``--last`` logged rows. ``--scale``
multiplies evaluation and training returns (e.g. by the number of agents, to turn the per-agent
mean that ``mappo`` logs into a team sum).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path / "metrics.csv", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def run_row(
    run: Path, metric: str, threshold: float | None, scale: float, last: int, last_evals: int
) -> list[str]:
    """The table cells of one run directory."""
    rows = _rows(run)
    if not rows:
        raise SystemExit(f"{run}: metrics.csv has no rows yet")
    evals = [
        (int(r["env_steps"]), float(r["wall_seconds"]), float(r[metric]) * scale)
        for r in rows
        if r.get(metric)
    ]
    if not evals:
        raise SystemExit(f"{run}: no '{metric}' values in metrics.csv (see its header)")
    train = [
        float(r["train/episode_return"]) * scale for r in rows if r.get("train/episode_return")
    ]
    task = run.parent.parent.name
    seed = run.name.rsplit("seed", 1)[-1]
    best = max(evals, key=lambda e: e[2])
    cells = [
        task,
        seed,
        f"{int(rows[-1]['env_steps']) / 1e6:.2f}M",
        f"{float(rows[-1]['wall_seconds']):.0f} s",
    ]
    if threshold is not None:
        first = next(((s, w) for s, w, v in evals if v >= threshold), None)
        cells.append(f"{first[0] / 1e3:.0f}k steps, {first[1]:.0f} s" if first else "not reached")
    median = statistics.median(v for _, _, v in evals[-last_evals:])
    cells += [f"{best[2]:.2f} ({best[0] / 1e3:.0f}k)", f"{evals[-1][2]:.2f}", f"{median:.2f}"]
    tail = train[-last:]
    cells.append(f"{sum(tail) / len(tail):.2f}" if tail else "")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--metric", default="eval/eval_battle_won")
    parser.add_argument("--threshold", type=float, default=None)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--last", type=int, default=10, help="training rows to average")
    parser.add_argument(
        "--last-evals", type=int, default=10, help="final evaluations to take the median of"
    )
    args = parser.parse_args()
    header = ["task", "seed", "env steps", "wall"]
    header += ["first >= threshold"] if args.threshold is not None else []
    header += ["best (at)", "final", f"median of last {args.last_evals}", "train (last rows)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for run in sorted(
        args.runs, key=lambda p: (p.parent.parent.name, p.name.rsplit("seed", 1)[-1])
    ):
        print(
            "| "
            + " | ".join(
                run_row(run, args.metric, args.threshold, args.scale, args.last, args.last_evals)
            )
            + " |"
        )


if __name__ == "__main__":
    main()
