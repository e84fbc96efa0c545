"""benchmarks/hanabi_throughput.py: our Hanabi's rows and the outputs-only floor beside them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bench_scripts import load  # noqa: E402


def _module():
    return load("hanabi_throughput")


def test_rows_for_ours_and_the_floor(monkeypatch, capsys) -> None:
    import torch

    threads = torch.get_num_threads()
    argv = ["hanabi_throughput.py", "--num-envs", "8", "--floor", "--seconds", "0.05", "--json"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        _module().main()
    finally:
        torch.set_num_threads(threads)  # the script pins one thread
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["env"] for r in rows] == ["hanabi/full-2p", "outputs only (floor)"]
    assert all(r["num_envs"] == 8 and r["sps"] > 0 and r["device"] == "cpu" for r in rows)


@pytest.mark.parametrize("players,dtype", [(2, "uint8"), (4, "uint8"), (2, "float32")])
def test_the_floor_makes_what_a_step_returns(players, dtype) -> None:
    """The floor's tensors have the shapes and dtype of a step's observations and state."""
    from mappo.envs import make

    obs, state, final_obs, final_state = _module().output_step(players, 4, "cpu", dtype)()
    step = make(f"hanabi/full-{players}p", num_envs=4, dtype=dtype).reset()
    for ours, theirs in ((obs, step.obs["players"]), (state, step.state)):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert final_obs.shape == obs.shape and final_state.shape == state.shape
    assert final_obs.data_ptr() != obs.data_ptr()  # copies, as the env's pre-reset views
