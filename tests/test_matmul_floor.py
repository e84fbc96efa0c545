"""``benchmarks/matmul_floor.py``: products recorded with their layouts, counted and replayed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_scripts import load  # noqa: E402


def test_products_are_recorded_with_their_layouts_and_counted() -> None:
    module = load("matmul_floor")
    a, b = torch.randn(6, 4), torch.randn(5, 4)  # b.T: a transposed view
    bias, batch = torch.randn(5), torch.randn(3, 6, 4)

    def work() -> torch.Tensor:
        y = torch.nn.functional.linear(a, b, bias)  # addmm with b.T's strides
        z = a @ b.T  # mm
        w = batch @ b.T.expand(3, 4, 5)  # bmm
        return y + z + w.sum(0) + torch.tanh(y)  # no product

    out, calls = module.record(work)
    assert out.shape == (6, 5)
    names = [f.__name__ for f, _ in calls]
    assert names == ["addmm.default", "mm.default", "bmm.default"]
    _, addmm_layout = calls[0]
    assert addmm_layout[1] == ((6, 4), (4, 1), torch.float32)
    assert addmm_layout[2] == ((4, 5), (1, 4), torch.float32)  # the transposed view's strides
    replayed = module.materialise(calls)
    assert replayed[0][1][2].stride() == (1, 4)
    assert module.flops(replayed) == 2 * 6 * 4 * 5 * 2 + 2 * 3 * 6 * 4 * 5
    assert module.replay(replayed) > 0


def test_a_short_run_reports_the_products_of_an_iteration(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both GRU paths: through autograd the recurrence's own products are recorded as well
    (the library's loops run them in C where they build, in torch otherwise)."""
    from mappo.nn import gru_sequence, layers

    module = load("matmul_floor")
    # --autograd sets these module globals: restored after the test
    for name in ("SEQUENCE_MAX_STEP", "SEQUENCE_NATIVE_MAX_STEP"):
        monkeypatch.setattr(layers, name, getattr(layers, name))
    argv = ["matmul_floor.py", "mpe/simple_spread", "env.num_envs=4", "rollout_length=10"]
    argv += ["--warmup", "1", "--replays", "2", "--threads", "1", "--json"]
    results = {}
    for extra in ([], ["--autograd"]):
        monkeypatch.setattr(sys, "argv", argv + extra)
        module.main()
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["products"] > 0 and result["gflop"] > 0
        assert len(result["products_seconds_range"]) == 2
        results[result["gru_path"]] = result
    assert set(results) == {"library", "autograd"}
    if gru_sequence.native_library(torch.float32) is not None:
        assert results["autograd"]["products"] > results["library"]["products"]
