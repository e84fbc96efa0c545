"""Training throughput of two or more variants of a preset, measured in one process.

A variant is a set of config overrides (``compile=on model.precision=bf16``), optionally with
inductor options for its compiled graphs (``inductor={"cpp.use_decompose_tanh":true}``, JSON
without spaces, passed to every ``torch.compile`` of that trainer through
:data:`mappo.compiled.CPU_OPTIONS`). One trainer per variant is built and warmed up, then timed
in windows of ``--iterations`` iterations that alternate between the trainers, ``--rounds``
times (the order flips every round). On a VM whose speed wanders by 1.5x within minutes, the
ratio of two windows measured back to back is steadier than runs in separate processes minutes
apart. All variants share the process's torch threads (``--threads``). The token
``rollout=float32`` builds that variant's rollout in float32 even where the env declares byte
observations (``mappo.rollout.stored_dtypes``), to time the byte storage against it.

    python benchmarks/alternating.py mpe/simple_spread_jaxmarl_ff \\
        'compile=on inductor={}' 'compile=on inductor={"cpp.use_decompose_tanh":true}' \\
        [--rounds 10] [--iterations 20] [--threads 2] [--json]
    python benchmarks/alternating.py hanabi/full-2p_fast '' 'rollout=float32' --iterations 2
    python benchmarks/alternating.py mpe/simple_spread compile=on 'compile=on wrapper=off'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def parse_variant(text: str) -> tuple[list[str], dict[str, Any] | None, bool, bool]:
    """A variant's config overrides, its inductor options (``None``: the library's own),
    whether its rollout stores float32 whatever the env declares, and whether its CPU graphs
    called many times an iteration get a C++ wrapper (the library's default;
    ``wrapper=off``: inductor's Python wrapper, :data:`mappo.compiled.WRAPPER_OPTIONS`)."""
    overrides, options, float_rollout, wrapper = [], None, False, True
    for token in text.split():
        if token == "rollout=float32":
            float_rollout = True
        elif token == "wrapper=off":
            wrapper = False
        elif token.startswith("inductor="):
            options = json.loads(token[len("inductor=") :])
            if not isinstance(options, dict):
                raise SystemExit(f"inductor= takes a JSON object, got {token!r}")
        elif token.startswith("threads="):
            raise SystemExit("the variants share the process's threads: use --threads")
        else:
            overrides.append(token)
    return overrides, options, float_rollout, wrapper


def summarise(names: list[str], windows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians per variant of the windows' milliseconds per iteration (``total``, ``rollout``,
    ``update``), and each variant's per-round ratio to the first (first / other: above 1 means
    the other variant is faster)."""
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
    parser.add_argument("variants", nargs="+", help="config overrides, one quoted string each")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from mappo import compiled, rollout
    from mappo import config as config_mod
    from mappo.trainer import Trainer

    library_options = dict(compiled.CPU_OPTIONS)
    library_wrapper = dict(compiled.WRAPPER_OPTIONS)
    learners: dict[str, Any] = {}
    counters: dict[str, int] = {}
    for text in args.variants:
        overrides, options, float_rollout, wrapper = parse_variant(text)
        compiled.CPU_OPTIONS = library_options if options is None else options
        compiled.WRAPPER_OPTIONS = library_wrapper if wrapper else {}
        stored = rollout.stored_dtypes
        if float_rollout:
            rollout.stored_dtypes = lambda env, source: (torch.float32, torch.float32)
        # a budget far beyond the windows, so that no schedule ends or anneals to zero
        cfg = config_mod.load(
            args.preset,
            [*overrides, f"threads={args.threads}", "total_env_steps=1000000000"],
        )
        learner = Trainer(cfg).learner
        rollout.stored_dtypes = stored
        for i in range(args.warmup):
            learner.iterate(i, 0)
        learners[text], counters[text] = learner, args.warmup
    # the options are read when a trainer compiles its functions: the library's own again
    compiled.CPU_OPTIONS, compiled.WRAPPER_OPTIONS = library_options, library_wrapper
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
