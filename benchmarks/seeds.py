"""Many seeds in one process (``num_seeds=N``) against one seed, preset by preset.

Each measurement is one ``mappo bench train PRESET num_seeds=N compile=... --json`` in its own
process; the env steps/s of all N seeds together are divided by the one-seed figure measured in
the same invocation (same compile setting), so the ratio is what stacking buys on this machine.
The settings are measured round-robin, ``--rounds`` times, and the medians reported.

    python benchmarks/seeds.py [--presets mpe/simple_spread_jaxmarl_ff ...] [--seeds 1 4 10]
        [--compile off on] [--threads 2] [--iterations 5] [--rounds 2] [--device cpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any


def bench(preset: str, seeds: int, setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``mappo bench train`` in a fresh process."""
    cmd = [
        sys.executable, "-m", "mappo.cli", "bench", "train", preset, f"num_seeds={seeds}",
        f"compile={setting}", f"threads={args.threads}", f"device={args.device}",
        "--iterations", str(args.iterations), "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _median_ms(results: list[dict[str, Any]], key: str) -> float | None:
    """Median of ``key`` in milliseconds; None where a run could not time it apart (the env
    step compiled into the policy's graph)."""
    values = [r[key] for r in results]
    return None if None in values else statistics.median(values) * 1e3


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["mpe/simple_spread_jaxmarl_ff"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 4, 10])
    parser.add_argument("--compile", nargs="+", default=["off", "on"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if 1 not in args.seeds:
        args.seeds = [1, *args.seeds]
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for preset in args.presets:
            for setting in args.compile:
                for n in args.seeds:
                    key = (preset, setting, n)
                    runs.setdefault(key, []).append(bench(preset, n, setting, args))
    rows = []
    for (preset, setting, n), results in runs.items():
        sps = statistics.median(r["steps_per_second"] for r in results)
        one = statistics.median(r["steps_per_second"] for r in runs[(preset, setting, 1)])
        rows.append(
            {
                "preset": preset,
                "compile": setting,
                "num_seeds": n,
                "steps_per_second": sps,
                "per_seed": sps / n,
                "vs_one_seed": sps / one,
                "env_ms": _median_ms(results, "env_seconds_per_iteration"),
                "acting_ms": _median_ms(results, "acting_seconds_per_iteration"),
                "update_ms": statistics.median(r["update_seconds_per_iteration"] for r in results)
                * 1e3,
                "compile_seconds": max(r["compile_seconds"] for r in results),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| preset | compile | seeds | env steps/s (all seeds) | per seed | x one seed "
          "| env / acting / update ms per iteration | compile s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['preset']}` | {r['compile']} | {r['num_seeds']} | "
            f"{r['steps_per_second']:,.0f} | {r['per_seed']:,.0f} | {r['vs_one_seed']:.2f} | "
            f"{_ms(r['env_ms'])} / {_ms(r['acting_ms'])} / {r['update_ms']:.0f} | "
            f"{r['compile_seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
