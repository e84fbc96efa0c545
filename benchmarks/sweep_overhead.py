"""Sweep overhead: 3 configurations x 3 seeds of a ~60-second trial, 2 at a time, against the
ideal wall time of the same trials.

First one trial is trained alone with ``mappo train`` (one torch thread, the trial's settings):
its wall time is the "60-second trial". Then ``mappo sweep`` runs the 9 trials on the chosen
backend with one CPU each (2 at a time on a 2-core machine). Two ideals are reported:

- *ideal (alone)*: the 9 trials packed on 2 slots (longest first) with each taking the alone
  time, i.e. ``ceil(9 / 2)`` rounds of it: what a sweep with no overhead and no contention
  between its parallel trials would take;
- *ideal (measured)*: the same packing of the 9 trials' own measured times inside the sweep
  (``sweep.json``): the overhead of the sweep machinery alone (start-up of Ray and its
  workers, scheduling, reading back), without the slow-down of two trials sharing the memory
  bus.

    python benchmarks/sweep_overhead.py --steps 450000      # about 7 minutes on a 2-core CPU
    python benchmarks/sweep_overhead.py --backend serial --slots 1
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESET = "mpe/simple_spread_fast"


def _makespan(durations: list[float], slots: int) -> float:
    """Longest-first packing of ``durations`` onto ``slots`` parallel slots."""
    finish = [0.0] * slots
    for d in sorted(durations, reverse=True):
        heapq.heapreplace(finish, finish[0] + d)
    return max(finish)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300_000, help="env steps per trial")
    parser.add_argument("--backend", default="ray", choices=("ray", "serial"))
    parser.add_argument("--slots", type=int, default=2, help="trials at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        common = {"total_env_steps": args.steps, "tensorboard": False}
        spec = root / "overhead.yaml"
        spec.write_text(
            json.dumps(
                {
                    "presets": [PRESET],
                    "seeds": 3,
                    "overrides": common,
                    "grid": {"algo.clip": [0.1, 0.2, 0.3]},
                    "resources": {"cpus": 1},
                    "max_concurrent": args.slots,
                }
            )
        )
        alone_cmd = [sys.executable, "-m", "mappo.cli", "train", PRESET, "threads=1",
                     "progress=false", "tensorboard=false", f"total_env_steps={args.steps}",
                     f"run_dir={root / 'alone'}"]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(alone_cmd, check=True, capture_output=True)
        alone = time.perf_counter() - start
        sweep_cmd = [sys.executable, "-m", "mappo.cli", "sweep", str(spec), "--dir",
                     str(root / "sweep"), "--backend", args.backend]  # fmt: skip
        start = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        subprocess.run(sweep_cmd, check=True, capture_output=True, env=env)
        wall = time.perf_counter() - start
        status = json.loads((root / "sweep" / "sweep.json").read_text())
        measured = [t["seconds"] for t in status["trials"]]
    ideal_alone = _makespan([alone] * len(measured), args.slots)
    ideal_measured = _makespan(measured, args.slots)
    print(
        json.dumps(
            {
                "backend": args.backend,
                "slots": args.slots,
                "trials": len(measured),
                "trial_alone_seconds": round(alone, 1),
                "trial_seconds_in_sweep": [round(s, 1) for s in measured],
                "sweep_wall_seconds": round(wall, 1),
                "ideal_alone_seconds": round(ideal_alone, 1),
                "ideal_measured_seconds": round(ideal_measured, 1),
                "wall_over_ideal_alone": round(wall / ideal_alone, 3),
                "wall_over_ideal_measured": round(wall / ideal_measured, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
