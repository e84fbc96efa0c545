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


def test_run_env_bench_without_pettingzoo() -> None:
    rows = run_env_bench(num_envs=(2,), seconds=0.01, include_pettingzoo=False)
    assert len(rows) == 1 and rows[0]["env"] == "mpe/simple_spread"
    assert "x reference" not in format_table(rows)


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
