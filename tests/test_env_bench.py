"""The environment throughput benchmark returns well-formed rows (no timing assertions)."""

from __future__ import annotations

import re
from pathlib import Path

from mappo.bench.env import format_table, run_env_bench


def test_run_env_bench_rows() -> None:
    rows = run_env_bench(
        env_names=("mpe/simple_spread", "mpe/simple_speaker_listener"),
        num_envs=(1, 8),
        seconds=0.02,
        include_pettingzoo=True,
    )
    assert [(r["env"], r["num_envs"]) for r in rows] == [
        ("mpe/simple_spread", 1),
        ("mpe/simple_spread", 8),
        ("mpe/simple_speaker_listener", 1),
        ("mpe/simple_speaker_listener", 8),
        ("mpe2", 1),
    ]
    for row in rows:
        assert set(row) == {"env", "num_envs", "steps_per_second", "device"}
        assert isinstance(row["steps_per_second"], float) and row["steps_per_second"] > 0
        assert row["device"] == "cpu"
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert "steps/s" in lines[0] and "x reference" in lines[0]
    assert lines[-1].split()[0] == "mpe2" and lines[-1].split()[-1] == "1.0"


def test_the_mpe2_row_is_left_out_with_a_note_where_mpe2_is_missing(monkeypatch) -> None:
    """A plain install (no pettingzoo extra) times the env and names what the reference needs
    (the run ended in a traceback after timing)."""
    import importlib.util

    import pytest

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mpe2" else found(name, *a)
    )
    with pytest.warns(UserWarning, match="the mpe2 reference row is left out: mpe2 is not inst"):
        rows = run_env_bench(num_envs=(2,), seconds=0.01, include_pettingzoo=True)
    assert [r["env"] for r in rows] == ["mpe/simple_spread"]


def test_run_env_bench_without_pettingzoo() -> None:
    rows = run_env_bench(num_envs=(2,), seconds=0.01, include_pettingzoo=False)
    assert len(rows) == 1 and rows[0]["env"] == "mpe/simple_spread"
    assert "x reference" not in format_table(rows)


def test_only_particle_worlds_are_compared_with_mpe2() -> None:
    # The combat simulator (or VMAS) has no reference row: no ratio, and no mpe2 row timed.
    rows = run_env_bench(("smac/3m",), (2,), seconds=0.02, include_pettingzoo=True)
    assert [r["env"] for r in rows] == ["smac/3m"]
    rows += [{"env": "mpe2", "num_envs": 1, "steps_per_second": 10.0, "device": "cpu"}]
    rows += [{"env": "mpe/simple_spread", "num_envs": 1, "steps_per_second": 20.0, "device": "cpu"}]
    smac, _, spread = (line.split() for line in format_table(rows).splitlines()[2:])
    assert len(smac) == 4 and spread[-1] == "2.0"


def test_hanabi_is_compared_with_open_spiel() -> None:
    """A Hanabi row gets OpenSpiel's game of the same player count as its reference (the mpe2
    row is left out when no particle env is measured)."""
    rows = run_env_bench(("hanabi/full-3p",), (4,), seconds=0.02, include_pettingzoo=True)
    assert [(r["env"], r["num_envs"]) for r in rows] == [
        ("hanabi/full-3p", 4),
        ("open_spiel:hanabi-3p", 1),
    ]
    assert all(r["steps_per_second"] > 0 for r in rows)
    last = format_table(rows).splitlines()[-1].split()
    assert last[0] == "open_spiel:hanabi-3p" and last[-1] == "1.0"


def test_run_env_bench_samples_masked_envs_from_their_masks() -> None:
    # The masked example env of docs/environments.md registers "example/guess_the_color"; the
    # bench picks its actions from the masks every step (masked_choice, which random_actions
    # uses and test_rendering.py tests for masks).
    docs = Path(__file__).parent.parent / "docs" / "environments.md"
    block = next(
        b
        for b in re.findall(r"```python\n(.*?)```", docs.read_text(), re.DOTALL)
        if "class GuessTheColor" in b
    )
    exec(compile(block, str(docs), "exec"), {"__name__": "docs_example"})
    rows = run_env_bench(("example/guess_the_color",), (3,), seconds=0.01, include_pettingzoo=False)
    assert rows[0]["steps_per_second"] > 0


def test_compiled_particle_world_rows_match_an_eager_copy() -> None:
    rows = run_env_bench(
        env_names=("mpe/simple_spread",),
        num_envs=(6,),
        seconds=0.05,
        include_pettingzoo=False,
        compiled=True,
    )
    assert [r["env"] for r in rows] == ["mpe/simple_spread", "mpe/simple_spread compiled"]
    compiled = rows[1]
    # (bench_compiled raises if no step ran compiled, so the row is a compiled one)
    assert compiled["steps_per_second"] > 0
    # The same arithmetic as the eager step, up to rounding, after 3.5 episodes.
    assert compiled["state_diff"] < 1e-4
    assert "state diff vs eager" in format_table(rows)


def test_the_compiled_stepper_state_check_sees_other_actions() -> None:
    """The check compares mid-episode states: an eager copy driven through other actions
    differs, so a stepper that took the wrong actions would not pass."""
    import torch

    from mappo.bench.env import CompiledStepper, _ring_of_actions
    from mappo.envs import make

    def env():
        e = make("mpe/simple_spread", num_envs=4, seed=0)
        e.validate_actions = False
        e.reset(seed=0)
        return e

    compiled, eager, shifted = env(), env(), env()
    gen = torch.Generator().manual_seed(0)
    stepper = CompiledStepper(compiled, _ring_of_actions(compiled, gen))
    with torch.no_grad():
        while stepper.count < 40:
            stepper.advance()
        assert {taken for _, taken in stepper.log} == {8}  # episode ends inside blocks too
        stepper.replay(eager)
        for i in range(stepper.count):  # each step one action batch later
            shifted.step(stepper.actions[(i + 1) % len(stepper.actions)])
    mine, same, other = compiled.get_state(), eager.get_state(), shifted.get_state()
    for k in mine:
        torch.testing.assert_close(mine[k], same[k], rtol=0, atol=1e-5)
    assert (mine["agent_pos"] - other["agent_pos"]).abs().max() > 1e-3


def test_the_compiled_bench_refuses_to_time_an_env_it_cannot_compile(monkeypatch) -> None:
    """A particle world that never lets a block be traced would be timed eagerly under the
    compiled row's name: the bench says so instead."""
    import pytest

    from mappo.bench.env import bench_compiled
    from mappo.envs.mpe.core import ParticleEnv

    monkeypatch.setattr(ParticleEnv, "claim_traced_steps", lambda self, count: None)
    with pytest.raises(RuntimeError, match="no steps were compiled"):
        bench_compiled("mpe/simple_spread", 4, 0.01)
