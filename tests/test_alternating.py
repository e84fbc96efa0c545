"""``benchmarks/alternating.py``: variants parsed, and the summary of alternating windows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bench_scripts import load  # noqa: E402


def test_summary_takes_medians_and_ratios_round_by_round() -> None:
    module = load("alternating")
    windows = {
        "a": [
            {"total": 10.0, "rollout": 4.0, "update": 6.0},
            {"total": 30.0, "rollout": 12.0, "update": 18.0},
            {"total": 12.0, "rollout": 5.0, "update": 7.0},
        ],
        "b": [
            {"total": 5.0, "rollout": 2.0, "update": 3.0},
            {"total": 20.0, "rollout": 8.0, "update": 12.0},
            {"total": 12.0, "rollout": 6.0, "update": 6.0},
        ],
    }
    out = module.summarise(["a", "b"], windows)
    assert out["a"]["total"] == 12.0 and out["a"]["rollout"] == 5.0 and out["a"]["update"] == 7.0
    assert out["a"]["ratio_to_first"] == [1.0, 1.0, 1.0]
    # ratios are taken window by window (the slow second round counts against both sides)
    assert out["b"]["ratio_to_first"] == pytest.approx([2.0, 1.5, 1.0])
    assert out["b"]["median_ratio_to_first"] == pytest.approx(1.5)
    assert out["b"]["total"] == 12.0 and out["b"]["update"] == 6.0


def test_variants_are_overrides_with_optional_inductor_options() -> None:
    module = load("alternating")
    assert module.parse_variant("compile=on model.precision=bf16") == (
        ["compile=on", "model.precision=bf16"],
        None,
        False,
        True,
    )
    overrides, options, floats, wrapper = module.parse_variant(
        'compile=on inductor={"cpp.use_decompose_tanh":true}'
    )
    assert overrides == ["compile=on"] and options == {"cpp.use_decompose_tanh": True}
    assert not floats and wrapper
    assert module.parse_variant("rollout=float32 seed=2") == (["seed=2"], None, True, True)
    assert module.parse_variant("compile=on wrapper=off") == (["compile=on"], None, False, False)
    with pytest.raises(SystemExit, match="--threads"):
        module.parse_variant("compile=on threads=1")
    with pytest.raises(SystemExit, match="JSON object"):
        module.parse_variant("inductor=[1]")


def test_a_tiny_comparison_runs_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load("alternating")
    small = "env.num_envs=2 rollout_length=4 algo.epochs=1 algo.data_chunk_length=2 progress=False"
    argv = ["alternating.py", "mpe/simple_spread", small, f"{small} algo.num_minibatches=2"]
    argv += ["--rounds", "2", "--iterations", "1", "--warmup", "1", "--threads", "1", "--json"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(tmp_path)
    module.main()
    assert not any(tmp_path.iterdir())  # the trainers write no run directories
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["ms_per_iteration"]
    assert out["preset"] == "mpe/simple_spread" and list(rows) == argv[2:4]
    for row in rows.values():
        assert len(row["ratio_to_first"]) == 2 and row["total"] > 0 and row["update"] > 0


def test_a_float_rollout_variant_against_the_byte_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rollout=float32`` builds its trainer's rollout in float32 (Hanabi's default storage is
    bytes) and leaves the library's choice in place for the other variants."""
    from mappo import rollout
    from mappo.learners import ppo

    module = load("alternating")
    small = "env.name=hanabi/small-2p env.num_envs=2 rollout_length=4 algo.epochs=1"
    argv = ["alternating.py", "hanabi/full-2p_fast", small, f"{small} rollout=float32"]
    argv += ["--rounds", "1", "--iterations", "1", "--warmup", "1", "--threads", "1", "--json"]
    made = []
    allocate = rollout.allocate

    def recording(policy, env, length, bootstrap):
        ro = allocate(policy, env, length, bootstrap)
        made.append(ro.groups["players"].obs.dtype)
        return ro

    monkeypatch.setattr(ppo, "allocate", recording)
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(tmp_path)
    choice = rollout.stored_dtypes
    module.main()
    assert made == [rollout.torch.uint8, rollout.torch.float32]
    assert rollout.stored_dtypes is choice
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ms_per_iteration"]
    assert list(rows) == argv[2:4]
