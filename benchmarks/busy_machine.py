"""Training speed with another program holding a core: the thread governor against fixed threads.

Runs the README's first command (``mappo train mpe/simple_spread_fast total_env_steps=300000``)
with the default thread setting (``threads=0``, the governor) and with a fixed thread count (the
machine's core count: what torch used by default before the governor), first on the idle
machine and then beside a busy loop (``python3 -c "while True: pass"``) that keeps one core busy.
A fixed count beside the busy loop can be very slow, so that row trains ``--busy-fixed-steps``
steps only; idle rows are the median of ``--repeats`` runs in alternation; every row reports
wall seconds (of the whole command, start-up and evaluations
included) and the env steps/s of its summary.

    python benchmarks/busy_machine.py            # about 6 minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _train(threads: int, steps: int, run_dir: Path) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "mappo.cli", "train", "mpe/simple_spread_fast",
        f"total_env_steps={steps}", f"threads={threads}", f"run_dir={run_dir}",
        "progress=false",
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    wall = time.perf_counter() - start
    (summary,) = run_dir.rglob("summary.json")
    data = json.loads(summary.read_text())
    summary.unlink()
    return {
        "wall_seconds": round(wall, 1),
        "env_steps": data["env_steps"],
        "steps_per_second": round(data["steps_per_second"]),
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run of median wall time."""
    return sorted(runs, key=lambda r: r["wall_seconds"])[len(runs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300_000)
    p.add_argument("--busy-fixed-steps", type=int, default=32_000)
    p.add_argument("--fixed-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=3, help="idle runs of each setting")
    args = p.parse_args()
    fixed = f"threads={args.fixed_threads}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # Idle: the two settings in alternation, so that both see the same machine.
        idle: dict[str, list[dict[str, float]]] = {"auto (threads=0)": [], fixed: []}
        for i in range(args.repeats):
            idle["auto (threads=0)"].append(_train(0, args.steps, root / f"idle0_{i}"))
            idle[fixed].append(_train(args.fixed_threads, args.steps, root / f"idleN_{i}"))
        for label, runs in idle.items():
            rows.append(("idle", label, _median(runs)))
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            rows.append(("busy", "auto (threads=0)", _train(0, args.steps, root / "busy0")))
            rows.append(
                ("busy", fixed, _train(args.fixed_threads, args.busy_fixed_steps, root / "busyN"))
            )
        finally:
            busy.kill()
            busy.wait()
    print("| machine | threads | env steps | wall s | env steps/s |")
    print("|---|---|---|---|---|")
    for machine, label, r in rows:
        print(
            f"| {machine} | {label} | {r['env_steps']:,} | {r['wall_seconds']} | "
            f"{r['steps_per_second']:,} |"
        )


if __name__ == "__main__":
    main()
