"""Training throughput with ``compile=on`` against eager (``compile=off``), preset by preset.

Each measurement is one ``mappo bench train PRESET compile=... --json`` in its own process with
an empty inductor cache (so the compile time reported is a cold compile, as a user's first run
sees it). The two settings alternate, ``--rounds`` times, so that both see the same machine; the
median env steps/s of each side and the median ratio compiled / eager are reported, with the
cold compile time.

    python benchmarks/compiled.py [--presets mpe/simple_spread_jaxmarl_ff ...] [--threads 2]
        [--iterations 10] [--rounds 3] [--device cpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

PRESETS = [
    "mpe/simple_spread_jaxmarl_ff",
    "mpe/simple_spread_jaxmarl_rnn",
    "mpe/simple_spread",
    "mpe/simple_spread_fast",
]


def bench(preset: str, setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``mappo bench train`` in a fresh process and a fresh inductor cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        cmd = [
            sys.executable,
            "-m",
            "mappo.cli",
            "bench",
            "train",
            preset,
            f"compile={setting}",
            f"threads={args.threads}",
            f"device={args.device}",
            "--iterations",
            str(args.iterations),
            "--json",
        ]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=PRESETS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for preset in args.presets:
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for setting in ("off", "on"):
                runs[setting].append(bench(preset, setting, args))
        rate = {k: [r["steps_per_second"] for r in v] for k, v in runs.items()}
        row = {
            "preset": preset,
            "threads": args.threads,
            "device": args.device,
            "eager_steps_per_second": statistics.median(rate["off"]),
            "compiled_steps_per_second": statistics.median(rate["on"]),
            "ratio": statistics.median(
                on / off for on, off in zip(rate["on"], rate["off"], strict=True)
            ),
            "compile_seconds": statistics.median(r["compile_seconds"] for r in runs["on"]),
            "eager_rollout_ms": 1e3
            * statistics.median(r["rollout_seconds_per_iteration"] for r in runs["off"]),
            "compiled_rollout_ms": 1e3
            * statistics.median(r["rollout_seconds_per_iteration"] for r in runs["on"]),
            "eager_update_ms": 1e3
            * statistics.median(r["update_seconds_per_iteration"] for r in runs["off"]),
            "compiled_update_ms": 1e3
            * statistics.median(r["update_seconds_per_iteration"] for r in runs["on"]),
            "runs": runs,
        }
        rows.append(row)
        if not args.json:
            print(
                f"{preset}: eager {row['eager_steps_per_second']:,.0f} env steps/s "
                f"(rollout {row['eager_rollout_ms']:.0f} ms, update {row['eager_update_ms']:.0f} "
                f"ms), compiled {row['compiled_steps_per_second']:,.0f} (rollout "
                f"{row['compiled_rollout_ms']:.0f} ms, update {row['compiled_update_ms']:.0f} "
                f"ms), ratio {row['ratio']:.2f}, cold compile {row['compile_seconds']:.1f} s",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
