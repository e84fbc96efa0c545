"""``benchmarks/gpu_suite.sh``: its plumbing (time limits, outputs, the report over its runs) run
on the CPU with a small budget; on a GPU it runs the same commands at full size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).parent.parent / "benchmarks" / "gpu_suite.sh"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="bash")
def test_the_target_part_trains_its_seeds_and_reports_them(tmp_path):
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "COMPILE": "off",
        "SEEDS": "3 4",
        "EXTRA": "total_env_steps=25600 eval_interval=1 eval_episodes=4 threads=1",
        "MAPPO": f"{sys.executable} -m mappo.cli",
    }
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SUITE), str(out), "target"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    log = (out / "log.txt").read_text()
    for name in ("target_seed3", "target_seed4", "target_report"):
        assert f"end {name}: rc=0" in log, log
    (row,) = json.loads((out / "target_report.json").read_text())
    assert row["seeds"] == 2 and row["target"] == -120.0 and row["target_window"] == 3
    assert row["configuration"] == "mpe/simple_spread_gpu rmappo"
    assert row["reached"] == 0 and row["target_seconds"] is None  # 25,600 steps learn little
    # an unknown part is refused with the list of parts
    bad = subprocess.run(["bash", str(SUITE), str(out), "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr
