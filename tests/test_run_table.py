"""benchmarks/run_table.py: the table rows RESULTS.md is made of."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bench_scripts import load  # noqa: E402


def _module():
    return load("run_table")


def _write_run(run: Path, rows: list[dict[str, object]]) -> None:
    run.mkdir(parents=True)
    fields = ["env_steps", "wall_seconds", "train/episode_return", "eval/eval_battle_won"]
    with open(run / "metrics.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def test_rows_report_first_best_final_median_and_training_return(tmp_path: Path) -> None:
    run = tmp_path / "smac" / "3m" / "mappo" / "20260101-000000_seed2"
    _write_run(
        run,
        [
            {"env_steps": 1000, "wall_seconds": 1.0, "train/episode_return": 2.0},
            {"env_steps": 2000, "wall_seconds": 2.0, "eval/eval_battle_won": 0.5},
            {"env_steps": 3000, "wall_seconds": 3.0, "train/episode_return": 4.0},
            {"env_steps": 4000, "wall_seconds": 4.5, "eval/eval_battle_won": 0.96},
            {"env_steps": 5000, "wall_seconds": 6.0, "eval/eval_battle_won": 0.9},
        ],
    )
    row = _module().run_row(run, "eval/eval_battle_won", 0.95, 1.0, last=2, last_evals=3)
    # Median of the last three evaluations (0.5, 0.96, 0.9): 0.9.
    assert row == ["3m", "2", "0.01M", "6 s", "4k steps, 4 s", "0.96 (4k)", "0.90", "0.90", "3.00"]
    # Of the last two (0.96, 0.9), scaled by 2: the mean of the middle pair, 1.86.
    scaled = _module().run_row(run, "eval/eval_battle_won", None, 2.0, last=1, last_evals=2)
    assert scaled == ["3m", "2", "0.01M", "6 s", "1.92 (4k)", "1.80", "1.86", "8.00"]


def test_missing_metric_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "t" / "algo" / "x_seed1"
    _write_run(run, [{"env_steps": 1, "wall_seconds": 1.0, "train/episode_return": 0.0}])
    monkeypatch.setattr(sys, "argv", ["run_table.py", str(run), "--metric", "eval/nope"])
    with pytest.raises(SystemExit, match="no 'eval/nope' values"):
        _module().main()
