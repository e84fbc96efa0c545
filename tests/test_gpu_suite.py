"""``benchmarks/gpu_suite.sh``: its plumbing (outputs, the log, the report over its runs, the
refusals) run on the CPU with a small budget; on a GPU it runs the same commands at full
size."""

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
    # an unknown part is refused before anything runs, with the list of parts
    fresh = tmp_path / "fresh"
    bad = subprocess.run(
        ["bash", str(SUITE), str(fresh), "target", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr and not fresh.exists()
    # so is an output folder holding an earlier call's runs
    again = subprocess.run(["bash", str(SUITE), str(out), "target"], capture_output=True, text=True)
    assert again.returncode == 2 and "target_runs exists" in again.stderr
    # a part that fails is logged, the others run, and the script says so in its exit status
    env["MAPPO"] = f"{sys.executable} -m mappo.cli --no-such-option"
    broken = subprocess.run(
        ["bash", str(SUITE), str(tmp_path / "broken"), "paper"], env=env, capture_output=True
    )
    log = (tmp_path / "broken" / "log.txt").read_text()
    assert broken.returncode == 1 and "end paper_compile_off: rc=2" in log
    assert "end paper_compile_on: rc=2" in log and "some parts failed" in log


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="bash")
def test_the_hanabi_train_part_times_the_preset_and_learns_for_its_seconds(tmp_path):
    small = "env.num_envs=8 rollout_length=16 model.hidden_sizes=[32,32] eval_episodes=4"
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "COMPILE": "off",
        "HANABI_SEEDS": "2",
        "HANABI_SECONDS": "1",
        # (compile=off last: the compiled bench's setting is overridden, so that the test
        # checks the plumbing without a cold compile)
        "EXTRA": f"{small} threads=1 compile=off",
        "MAPPO": f"{sys.executable} -m mappo.cli",
    }
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SUITE), str(out), "hanabi_train"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, (out / "log.txt").read_text()
    for mode in ("off", "on"):
        row = json.loads((out / f"hanabi_train_compile_{mode}.json").read_text())
        assert row["preset"] == "hanabi/full-2p_gpu" and row["steps_per_second"] > 0
    err = (out / "hanabi_learn_seed2.err").read_text()
    assert "stopped at max_wall_seconds=1 after " in err
    (row,) = json.loads((out / "hanabi_report.json").read_text())
    assert row["configuration"] == "hanabi/full-2p_gpu mappo" and row["seeds"] == 1
    # a second call into the same folder would report the first call's runs with its own
    again = subprocess.run(
        ["bash", str(SUITE), str(out), "hanabi_train"], capture_output=True, text=True
    )
    assert again.returncode == 2 and "hanabi_runs exists" in again.stderr
