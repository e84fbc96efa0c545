"""Compiled training throughput under different inductor options, measured in one process.

One trainer per option set (``compile=on``, the options passed to every ``torch.compile`` of the
run through :data:`mappo.compiled.CPU_OPTIONS`), each warmed up, then timed in windows of
``--iterations`` iterations that alternate between the trainers, ``--rounds`` times (the order
flips every round). On a VM whose speed wanders by 1.5x within minutes, the ratio of two windows
measured back to back is steadier than runs in separate processes minutes apart.

    python benchmarks/inductor_options.py mpe/simple_spread_jaxmarl_ff \\
        '{"cpp.use_decompose_tanh": false}' '{"cpp.use_decompose_tanh": true}' \\
        [--rounds 10] [--iterations 20] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def summarise(names: list[str], windows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians per option set of the windows' milliseconds per iteration (``total``, ``rollout``,
    ``update``), and each set's per-round ratio to the first set (first / other: above 1 means
    the other set is faster)."""
    out: dict[str, Any] = {}
    base = [w["total"] for w in windows[names[0]]]
    for name in names:
        ws = windows[name]
        row: dict[str, Any] = {
            k: statistics.median(w[k] for w in ws) for k in ("total", "rollout", "update")
        }
        ratios = [b / w["total"] for b, w in zip(base, ws, strict=True)]
        row["ratio_to_first"] = ratios
        row["median_ratio_to_first"] = statistics.median(ratios)
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("options", nargs="+", help="inductor options, one JSON object per set")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mappo import compiled
    from mappo import config as config_mod
    from mappo.trainer import Trainer

    learners: dict[str, Any] = {}
    counters: dict[str, int] = {}
    for text in args.options:
        compiled.CPU_OPTIONS = json.loads(text)
        # a budget far beyond the windows, so that no schedule ends or anneals to zero
        cfg = config_mod.load(
            args.preset, ["compile=on", f"threads={args.threads}", "total_env_steps=1000000000"]
        )
        learner = Trainer(cfg).learner
        for i in range(args.warmup):
            learner.iterate(i, 0)
        learners[text], counters[text] = learner, args.warmup
    names = list(learners)
    windows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            rollout = update = 0.0
            for _ in range(args.iterations):
                out = learners[name].iterate(counters[name], 0)
                counters[name] += 1
                rollout += out["rollout_seconds"]
                update += out["update_seconds"]
            n = args.iterations
            windows[name].append(
                {
                    "total": (time.perf_counter() - start) / n * 1e3,
                    "rollout": rollout / n * 1e3,
                    "update": update / n * 1e3,
                }
            )
    summary = summarise(names, windows)
    if args.json:
        print(json.dumps({"preset": args.preset, "ms_per_iteration": summary}))
        return
    for name, row in summary.items():
        print(
            f"{name}: {row['total']:.1f} ms/iteration (rollout {row['rollout']:.1f}, update "
            f"{row['update']:.1f}), first / this {row['median_ratio_to_first']:.3f} "
            f"(rounds: {', '.join(f'{x:.2f}' for x in row['ratio_to_first'])})"
        )


if __name__ == "__main__":
    main()
