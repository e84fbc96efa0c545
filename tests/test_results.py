"""Plots and reports over run directories: statistics against hand computations on synthetic
``metrics.csv`` files, one line and one band per configuration, the marl-eval export, CLI errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from mappo import config as C
from mappo.cli import main
from mappo.experiments import stats
from mappo.experiments.plot import aggregate, plot_curves
from mappo.experiments.report import first_reach, marl_eval, report_rows
from mappo.experiments.runs import WIN_RATE, ResultsError, find_runs, group_runs

RETURN = "eval/eval_return_mean"


def _fake_run(
    root: Path,
    seed: int,
    evals: list[tuple[int, float]],
    preset: str = "mpe/simple_spread_fast",
    complete: bool = True,
    **overrides,
) -> Path:
    """A run directory as mappo writes one: config.yaml and metrics.csv with evaluation rows
    (and training rows between them, which have no evaluation); with ``complete`` (and
    evaluations) a budget of the last evaluation's step and the summary.json of a run that
    trained it."""
    budget = {"total_env_steps": evals[-1][0]} if complete and evals else {}
    cfg = C.load(preset, {"seed": seed, **budget, **overrides})
    d = root / f"{preset}/{'_'.join(f'{k}{v}' for k, v in overrides.items())}/seed{seed}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(C.to_dict(cfg), sort_keys=False))
    lines = [f"env_steps,wall_seconds,train/episode_return,{RETURN}"]
    for step, value in evals:
        lines.append(f"{step - 50},{step / 100},{value - 1},")
        lines.append(f"{step},{step / 100},{value - 1},{value}")
    (d / "metrics.csv").write_text("\n".join(lines) + "\n")
    if complete and evals:
        (d / "summary.json").write_text(json.dumps({"env_steps": evals[-1][0]}))
    return d


def test_iqm_and_bootstrap_equal_hand_computations():
    x = np.array([3.0, -1.0, 7.0, 2.0, 10.0, 4.0, 0.5, 6.0])
    # n = 8: drop 2 from each end of the sorted values.
    assert stats.iqm(x) == pytest.approx(np.mean(sorted(x)[2:6]))
    assert stats.iqm(np.array([1.0, 5.0, 9.0])) == pytest.approx(5.0)  # n < 4: the mean
    got = stats.bootstrap(x, "iqm", confidence=0.9, samples=500, seed=7)
    rng = np.random.default_rng(7)
    draws = rng.integers(0, len(x), size=(500, len(x)))
    by_hand = []
    for row in draws:
        s = sorted(x[i] for i in row)
        by_hand.append(sum(s[2:6]) / 4)
    assert got.value == pytest.approx(stats.iqm(x))
    assert got.low == pytest.approx(np.quantile(by_hand, 0.05))
    assert got.high == pytest.approx(np.quantile(by_hand, 0.95))
    assert stats.bootstrap([4.0], "iqm") == (4.0, 4.0, 4.0)


def test_report_rows_equal_hand_computations(tmp_path):
    finals_a = [-150.0, -140.0, -160.0, -120.0]
    for seed, final in enumerate(finals_a, start=1):
        _fake_run(tmp_path, seed, [(1000, -200.0), (2000, final + 5), (3000, final)])
    _fake_run(tmp_path, 1, [(1000, -190.0), (3000, -130.0)], **{"algo.clip": 0.1})
    configs = group_runs(find_runs([tmp_path]))
    assert [c.label for c in configs] == [
        "mpe/simple_spread_fast rmappo algo.clip=0.1",
        "mpe/simple_spread_fast rmappo algo.clip=0.2",
    ]
    rows = report_rows(configs, RETURN, seed=3)
    a = rows[1]
    assert a.seeds == 4 and a.env_steps == 3000 and a.wall_seconds == 30
    assert a.final_mean == pytest.approx(np.mean(finals_a))
    assert a.best_mean == pytest.approx(np.mean([max(f, f + 5, -200) for f in finals_a]))
    assert a.final_iqm == pytest.approx(np.mean(sorted(finals_a)[1:3]))
    expected = stats.bootstrap(finals_a, "iqm", seed=3)
    assert (a.final_iqm_low, a.final_iqm_high) == (expected.low, expected.high)
    assert rows[0].seeds == 1 and rows[0].final_iqm == rows[0].final_iqm_low == -130.0


def test_time_to_a_target_is_judged_by_the_mean_of_consecutive_evaluations(tmp_path, capsys):
    """``--target``: per seed the first evaluation where the mean of it and the evaluations
    before it (``--window``) reaches the level, in env steps and wall seconds; a single lucky
    evaluation counts only with a window of one."""
    _fake_run(tmp_path, 1, [(1000, -130.0), (2000, -118.0), (3000, -121.0), (4000, -119.0)])
    _fake_run(tmp_path, 2, [(1000, -119.0), (2000, -119.0), (3000, -119.0), (4000, -125.0)])
    _fake_run(tmp_path, 3, [(1000, -150.0), (2000, -110.0), (3000, -150.0), (4000, -150.0)])
    configs = group_runs(find_runs([tmp_path]))
    (row,) = report_rows(configs, RETURN, target=-120.0)
    # seed 1: means of three -123.0, -119.3 (at 4000 steps, 40 s); seed 2: -119.0 at 3000
    # steps; seed 3 never (its one evaluation of -110 among -150s)
    assert (row.reached, row.seeds, row.target_window) == (2, 3, 3)
    assert row.target_steps == 3500 and row.target_seconds == 35 and row.target_seconds_max == 40
    (lucky,) = report_rows(configs, RETURN, target=-120.0, window=1)
    assert lucky.reached == 3 and lucky.target_seconds_max == 20  # seed 1 at 2000 steps
    (none,) = report_rows(configs, RETURN, target=-100.0)
    assert none.reached == 0 and np.isnan(none.target_steps) and np.isnan(none.target_seconds)
    assert np.isnan(report_rows(configs, RETURN)[0].target)
    with pytest.warns(UserWarning, match="4 evaluation.*fewer than --window=5.*cannot count"):
        assert report_rows(configs, RETURN, target=-120.0, window=5)[0].reached == 0
    steps = np.array([1.0, 2.0])
    assert first_reach(steps, steps, np.array([5.0, 5.0]), 0.0, 3) is None  # too few
    assert first_reach(steps, steps * 10, np.array([-1.0, 5.0]), 2.0, 2) == (2.0, 20.0)
    for level in (0.1, 0.7, 0.9, -50.3, -100.5):  # a mean equal to the level reaches it
        for window in (1, 2, 3, 5):
            flat = np.full(5, level)
            assert first_reach(flat, flat, flat, level, window) is not None, (level, window)
    assert main(["report", str(tmp_path), "--target", "-120"]) == 0
    out = capsys.readouterr().out
    assert "| reached -120 (mean of 3) | env steps to it (median) | wall to it" in out
    assert "| 2 / 3 | 3.5k | 35 s, 40 s |" in out
    assert main(["report", str(tmp_path), "--target", "-120", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["reached"] == 2
    assert main(["report", str(tmp_path), "--target", "-100", "--format", "json"]) == 0
    missed = json.loads(capsys.readouterr().out)[0]  # strict JSON: null, not NaN
    assert missed["reached"] == 0 and missed["target_seconds"] is None
    assert main(["report", str(tmp_path), "--target", "-120", "--window", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "mappo: error: --window must be at least 1 evaluation, not 0"
    assert main(["report", str(tmp_path), "--window", "2"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "mappo: error: --window needs --target (the level it judges)"
    )
    # a table without a target has no such columns, and its JSON no figures for them
    assert main(["report", str(tmp_path)]) == 0
    assert "reached" not in capsys.readouterr().out
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    plain = json.loads(capsys.readouterr().out)[0]
    assert plain["reached"] is plain["target"] is plain["target_window"] is None


def test_configurations_differing_in_an_env_keyword_are_labelled_by_it(tmp_path):
    """An env keyword argument that tells configurations apart names them as the sweep's grid
    does (``env.kwargs.NAME=value``), whether or not the other side sets it at all."""
    _fake_run(tmp_path, 1, [(1000, -170.0)], preset="mpe/simple_spread_mappo")
    for flag in (False, True):
        _fake_run(
            tmp_path / str(flag),
            1,
            [(1000, -150.0)],
            preset="mpe/simple_spread_mappo",
            **{"env.kwargs.time_feature": flag},
        )
    labels = [c.label for c in group_runs(find_runs([tmp_path]))]
    assert labels == [
        "mpe/simple_spread_mappo mappo env.kwargs.time_feature=-",
        "mpe/simple_spread_mappo mappo env.kwargs.time_feature=False",
        "mpe/simple_spread_mappo mappo env.kwargs.time_feature=True",
    ]


def test_plot_has_one_line_and_one_band_per_configuration(tmp_path):
    for seed in (1, 2, 3):
        _fake_run(tmp_path, seed, [(1000, -200.0 + seed), (2000, -150.0), (3000, -140.0 + seed)])
    for seed in (1, 2):
        _fake_run(tmp_path, seed, [(1000, -190.0), (4000, -120.0)], **{"algo.clip": 0.1})
    configs = group_runs(find_runs([tmp_path]))
    fig = plot_curves(configs, RETURN, out=tmp_path / "curves.png")
    ax = fig.axes[0]
    assert len(ax.lines) == 2 and len(ax.collections) == 2
    assert sorted(line.get_label() for line in ax.lines) == [
        "mpe/simple_spread_fast rmappo algo.clip=0.1 (2 seeds)",
        "mpe/simple_spread_fast rmappo algo.clip=0.2 (3 seeds)",
    ]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    grid, mean, low, high = aggregate(configs[1], RETURN, points=3)
    assert list(grid) == [1000, 2000, 3000]
    assert mean == pytest.approx([-198.0, -150.0, -138.0])
    assert np.all(low <= mean) and np.all(mean <= high)
    assert low[1] == high[1] == -150.0  # every seed equal: a zero-width band
    grid, _, _, _ = aggregate(configs[0], RETURN, x="wall_seconds", points=4)
    assert list(grid) == [10.0, 20.0, 30.0, 40.0]


def test_marl_eval_export_layout(tmp_path):
    _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0)])
    _fake_run(tmp_path, 2, [(1000, -180.0), (2000, -140.0)])
    data = marl_eval(group_runs(find_runs([tmp_path])), RETURN)
    runs = data["mpe"]["simple_spread"]["mpe/simple_spread_fast rmappo"]
    assert sorted(runs) == ["seed_1", "seed_2"]
    assert runs["seed_2"]["step_1"] == {"step_count": 2000, "return": [-140.0]}
    assert runs["seed_1"]["absolute_metrics"] == {"return": [-150.0]}
    # another metric keeps its own name: marl-eval's readers take "return" for a return
    other = marl_eval(group_runs(find_runs([tmp_path])), "train/episode_return")
    seed_1 = other["mpe"]["simple_spread"]["mpe/simple_spread_fast rmappo"]["seed_1"]
    assert seed_1["absolute_metrics"] == {"episode_return": [-151.0]}


def test_marl_eval_never_writes_over_a_runs_files_and_a_bad_seed_is_named(tmp_path, capsys):
    """--marl-eval replaced whatever it named (a run's metrics.csv, summary.json, a
    checkpoint); a seed of another type in a config.yaml edited by hand was a traceback."""
    run = _fake_run(tmp_path, 1, [(1000, -200.0)])
    before = (run / "metrics.csv").read_bytes()
    for target, message in (
        (run / "metrics.csv", "--marl-eval must name a .json file"),
        (run / "summary.json", "is inside the run directory"),
    ):
        assert main(["report", str(tmp_path), "--marl-eval", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert (run / "metrics.csv").read_bytes() == before
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace("seed: 1", "seed: [1]", 1))
    assert main(["report", str(run)]) == 2
    assert "has seed [1], not a whole number" in capsys.readouterr().err


def test_cli_report_plot_and_their_errors(tmp_path, capsys):
    _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0)])
    assert main(["report", str(tmp_path), "--marl-eval", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "| mpe/simple_spread_fast rmappo | 1 | 1 / 1 | 2k | 20 s | -150.00 |" in out
    assert "mpe" in json.loads((tmp_path / "m.json").read_text())
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["final_mean"] == -150.0
    assert (
        main(["plot", str(tmp_path), "--out", str(tmp_path / "c.svg"), "--x", "wall_seconds"]) == 0
    )
    assert (tmp_path / "c.svg").is_file()
    capsys.readouterr()
    for argv, message in [
        (["report", str(tmp_path / "missing")], "does not exist"),
        (["report", str(tmp_path), "--metric", "eval/nope"], "no run logs the column 'eval/nope'"),
        (["plot", str(tmp_path), "--out", str(tmp_path / "c.png"), "--metric", "x"], "'x'"),
        (["plot", str(tmp_path), "--out", str(tmp_path / "c.txt")], ".png, .pdf or .svg"),
        (["report", str(tmp_path / "m.json")], "no run directories"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mappo: error: ") and "\n" not in err and message in err
    for argv, message in [  # refused by the argument parser, which exits with 2
        (["report", str(tmp_path), "--target", "nan"], "must be a finite number"),
        (["report", str(tmp_path), "--target", "inf"], "must be a finite number"),
        (["bench", "env", "--seconds", "0"], "must be a positive number"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mappo: error: ") and "\n" not in err and message in err


def test_runs_without_values_are_left_out_and_each_task_gets_its_own_metric(tmp_path):
    """A seed stopped before its first evaluation, and a StarCraft-style run (win rate) beside
    particle-world runs (return): the report covers what there is, with warnings."""
    _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0)])
    _fake_run(tmp_path, 2, [(1000, -180.0), (2000, -130.0)])
    early = _fake_run(tmp_path, 3, [])
    smac = _fake_run(tmp_path, 1, [(1000, 0.5)], preset="smac/3m_fast")
    text = (smac / "metrics.csv").read_text().replace(RETURN, "eval/eval_battle_won")
    (smac / "metrics.csv").write_text(text)
    (early / "metrics.csv").write_text(f"env_steps,wall_seconds,{RETURN}\n50,1.0,\n")
    configs = group_runs(find_runs([tmp_path]))
    with pytest.warns(UserWarning, match="1 of 3 runs .* have no"):
        rows = report_rows(configs)
    by_task = {r.task: r for r in rows}
    assert by_task["mpe/simple_spread"].seeds == 2
    assert by_task["mpe/simple_spread"].final_mean == pytest.approx(-140.0)
    assert by_task["smac/3m"].metric == "eval/eval_battle_won"
    assert by_task["smac/3m"].final_mean == 0.5
    with pytest.warns(UserWarning, match="does not log"):
        fig = plot_curves(configs, RETURN)
    assert len(fig.axes) == 1 and len(fig.axes[0].lines) == 1


def test_a_seed_trained_twice_counts_once(tmp_path, capsys):
    """The same command run twice (seed 1 in two folders) is one seed, not two: counted twice it
    would narrow the interval. The run that trained further counts."""
    _fake_run(tmp_path / "a", 1, [(1000, -200.0)])
    _fake_run(tmp_path / "b", 1, [(1000, -190.0), (2000, -150.0)])
    _fake_run(tmp_path / "c", 2, [(1000, -180.0), (2000, -130.0)])
    with pytest.warns(UserWarning, match=r"seed1' \(seed 1\) repeats a seed .* counts once"):
        (conf,) = group_runs(find_runs([tmp_path]))
    assert [(r.seed, r.final(RETURN)) for r in conf.runs] == [(1, -150.0), (2, -130.0)]
    assert report_rows([conf])[0].seeds == 2
    assert sorted(marl_eval([conf])["mpe"]["simple_spread"][conf.label]) == ["seed_1", "seed_2"]


def test_runs_that_have_not_evaluated_yet_are_one_error(tmp_path, capsys):
    """Runs stopped before their first evaluation: plot and report say so (plot named a missing
    column, report printed an empty row and exited 0)."""
    early = _fake_run(tmp_path, 1, [])
    (early / "metrics.csv").write_text("env_steps,wall_seconds,train/episode_return\n50,1.0,-3\n")
    for argv in (
        ["plot", str(tmp_path), "--out", str(tmp_path / "c.png")],
        ["report", str(tmp_path)],
    ):
        assert main(argv) == 2
        assert "no run has evaluated yet" in capsys.readouterr().err
    (early / "metrics.csv").write_text(f"env_steps,wall_seconds,{RETURN}\n50,1.0,\n")
    with pytest.warns(UserWarning, match="have no"):
        with pytest.raises(ResultsError, match="no run has evaluated yet"):
            report_rows(group_runs(find_runs([tmp_path])))


def test_plot_draws_one_panel_per_task(tmp_path):
    """Several scenarios (a sweep of the paper's three particle worlds): one panel each, with
    that task's configurations, so that returns of different scales do not share an axis."""
    for seed in (1, 2):
        _fake_run(tmp_path, seed, [(1000, -150.0), (2000, -120.0 + seed)])
        _fake_run(
            tmp_path, seed, [(1000, -20.0), (2000, -11.0 - seed)], preset="mpe/simple_reference"
        )
        _fake_run(
            tmp_path, seed, [(1000, -21.0), (2000, -12.0)], preset="mpe/simple_reference_mappo"
        )
    configs = group_runs(find_runs([tmp_path]))
    fig = plot_curves(configs, RETURN, title="paper/mpe")
    assert [ax.get_title() for ax in fig.axes] == ["mpe/simple_reference", "mpe/simple_spread"]
    assert [len(ax.lines) for ax in fig.axes] == [2, 1]
    assert [len(ax.collections) for ax in fig.axes] == [2, 1]
    assert fig._suptitle.get_text() == "paper/mpe"


def test_a_row_still_being_written_is_not_read(tmp_path):
    """The last row of metrics.csv without its line end (a run writing it, or killed in the
    write) would read as a wrong number: -349.34 cut to -34."""
    from mappo.experiments.runs import last_logged_step, read_run

    run = _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0)])
    metrics = run / "metrics.csv"
    text = metrics.read_text()
    metrics.write_text(text + text.splitlines()[-1].replace("2000", "3000")[:6])
    record = read_run(run)
    assert list(record.columns["env_steps"]) == [950.0, 1000.0, 1950.0, 2000.0]
    assert last_logged_step(run) == 2000


def test_step_counts_read_at_every_scale():
    from mappo.experiments.report import _steps

    assert [_steps(v) for v in (500, 2000, 3500, 12_345, 2_500_000)] == [
        "500",
        "2k",
        "3.5k",
        "12k",
        "2.50M",
    ]
    assert _steps(float("nan")) == "-"


def test_a_configuration_with_one_evaluation_is_drawn_as_a_point(tmp_path, capsys):
    """A line of one point draws nothing: such a configuration (a short run evaluated once, at
    its end) gets a marker and its seeds' spread as an error bar."""
    for seed in (1, 2):
        _fake_run(tmp_path, seed, [(2000, -150.0 - seed)])
    (config,) = group_runs(find_runs([tmp_path]))
    fig = plot_curves([config], RETURN, out=tmp_path / "point.png")
    (line, *bar) = fig.axes[0].lines
    assert line.get_marker() == "o" and list(line.get_ydata()) == [-151.5]
    assert fig.axes[0].collections  # the error bar's segment
    # (a metric other than an evaluation's is not called one in the report's heading)
    assert main(["report", str(tmp_path), "--metric", "train/episode_return"]) == 0
    assert capsys.readouterr().out.startswith("Metric: `train/episode_return`\n")
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"Metric: `{RETURN}` (greedy evaluation)\n")


def test_report_leaves_out_a_configuration_that_does_not_log_the_metric(tmp_path, capsys):
    """As plot does: a MAPPO run beside a run that logs ``epsilon`` (QMIX's) gets no row of
    zero seeds, but a warning; a damaged header names the file, not "not a run directory"."""
    _fake_run(tmp_path, 1, [(1000, -200.0)])
    other = _fake_run(tmp_path, 1, [(1000, -190.0)], preset="smac/3m_fast")
    (other / "metrics.csv").write_text((other / "metrics.csv").read_text().replace(RETURN, "eps"))
    assert main(["report", str(tmp_path), "--metric", "eps"]) == 0
    out, err = capsys.readouterr()
    assert "smac/3m_fast mappo | 1 |" in out and "simple_spread" not in out
    assert "mappo: warning: 'mpe/simple_spread_fast rmappo' does not log 'eps'; left out" in err
    text = (other / "metrics.csv").read_text()
    (other / "metrics.csv").write_text(text.replace("env_steps", "env_stps", 1))
    assert main(["report", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"'{other / 'metrics.csv'}' has no env_steps column (its first line: " in err
    assert "restore its first line" in err
    # a header cut off before its line end (a kill while the file was created) or none at all
    for damaged in (text[:30], ""):
        (other / "metrics.csv").write_text(damaged)
        assert main(["report", str(other)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is empty or its header line is incomplete" in err


def test_report_keeps_a_configuration_that_has_not_evaluated_yet(tmp_path, capsys):
    """An evaluation's column appears with a run's first evaluation: with --metric eval/...
    a configuration whose runs are early keeps its row, with the "no values yet" warning."""
    _fake_run(tmp_path, 1, [(1000, -200.0)])
    early = _fake_run(tmp_path, 1, [], preset="smac/3m_fast")
    (early / "metrics.csv").write_text("env_steps,wall_seconds,train/episode_return\n50,1.0,-3\n")
    assert main(["report", str(tmp_path), "--metric", RETURN]) == 0
    out, err = capsys.readouterr()
    assert "| smac/3m_fast mappo | 0 |" in out and "have no" in err and "does not log" not in err


def test_the_paper_figure_stands_only_beside_the_preset_s_own_settings(tmp_path):
    _fake_run(tmp_path, 1, [(100, -130.0)], preset="mpe/simple_spread", total_env_steps=1000)
    _fake_run(tmp_path, 1, [(100, -150.0)], preset="mpe/simple_spread", **{"algo.clip": 0.1})
    rows = report_rows(group_runs(find_runs([tmp_path])), RETURN)
    papers = {row.configuration: row.paper for row in rows}
    assert papers["mpe/simple_spread rmappo algo.clip=0.2"].startswith("-117.3 training return")
    assert papers["mpe/simple_spread rmappo algo.clip=0.1"] == ""  # not the paper's settings


def test_a_yaml_file_s_run_with_a_preset_s_settings_is_a_seed_of_it(tmp_path):
    _fake_run(tmp_path, 1, [(100, -130.0)], **{"algo.clip": 0.1})
    mine = _fake_run(tmp_path / "yaml", 2, [(100, -140.0)], **{"algo.clip": 0.1})
    config = yaml.safe_load((mine / "config.yaml").read_text())
    (mine / "config.yaml").write_text(yaml.safe_dump({**config, "preset": ""}, sort_keys=False))
    (conf,) = group_runs(find_runs([tmp_path]))
    assert conf.label == "mpe/simple_spread_fast rmappo" and len(conf.runs) == 2


def test_report_warns_when_seeds_end_at_different_steps_and_plot_counts_what_it_drew(
    tmp_path, capsys
):
    """A stopped seed's last evaluation is an earlier one: the report says so (the plot cuts
    the seeds to their shared range); plot counts the configurations it drew, not those it
    left out."""
    _fake_run(tmp_path, 1, [(1000, -200.0), (3000, -150.0)])
    _fake_run(tmp_path, 2, [(1000, -210.0)])
    with pytest.warns(UserWarning, match="last evaluated '.*' at different env steps \\(1,000 to"):
        report_rows(group_runs(find_runs([tmp_path])), RETURN)
    other = _fake_run(tmp_path, 1, [(1000, -190.0)], preset="smac/3m_fast")
    (other / "metrics.csv").write_text((other / "metrics.csv").read_text().replace(RETURN, "eps"))
    assert main(["plot", str(tmp_path), "--metric", "eps", "--out", str(tmp_path / "p.png")]) == 0
    assert "1 configuration, metric eps" in capsys.readouterr().out


def test_the_report_counts_the_seeds_that_trained_their_whole_budget(tmp_path, capsys):
    """A configuration whose seeds diverged, failed or stopped short of total_env_steps looked
    like any other row but for its env steps: its row counts its complete seeds and names the
    failures, and a warning per configuration says what happened."""
    lr = {"algo.critic_lr": 1e6}
    for seed in (1, 2):
        good = _fake_run(tmp_path, seed, [(1000, -200.0), (2000, -150.0)])
        (good / "error.txt").write_text("OSError: from before it resumed and completed\n")
        bad = _fake_run(tmp_path, seed, [(1000, -400.0)], complete=False, **lr)
        error = "Traceback ...\nmappo.trainer.TrainingDiverged: training diverged\n"
        (bad / "error.txt").write_text(error if seed == 1 else "OSError: disk full\n\n")
    short = _fake_run(tmp_path, 3, [(1000, -190.0)], complete=False, total_env_steps=2000)
    (short / "summary.json").write_text(json.dumps({"env_steps": 1000}))  # stopped, resumable
    # diverged before its first evaluation: no value of the metric, but a seed all the same
    early = _fake_run(tmp_path, 3, [], complete=False, **lr)
    with (early / "metrics.csv").open("a", encoding="utf-8") as f:
        f.write("500,5.0,-420.0,\n")  # a training row, no evaluation
    (early / "error.txt").write_text("mappo.trainer.TrainingDiverged: training diverged\n")
    assert main(["report", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "algo.critic_lr=0.0015 | 3 | 2 / 3 | 1.67k |" in out
    assert "algo.critic_lr=1000000.0 | 2 | 0 / 3 (2 diverged, 1 failed) | 1k |" in out
    assert f"failed before any '{RETURN}' value (see error.txt in '{early}')" in err
    assert err.count("warning") == 3
    assert (
        "'mpe/simple_spread_fast rmappo algo.critic_lr=0.0015': 1 of 3 seeds are incomplete (1 "
        "stopped before total_env_steps or still training); the row's figures are from where "
        "they stopped"
    ) in err
    assert (
        "'mpe/simple_spread_fast rmappo algo.critic_lr=1000000.0': 3 of 3 seeds are incomplete "
        "(2 diverged, 1 failed: see error.txt in '"
    ) in err
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [
        (r["seeds"], r["trained"], r["complete"], r["failed"], r["diverged"]) for r in rows
    ] == [(3, 3, 2, 0, 0), (2, 3, 0, 3, 2)]


def test_seeds_of_one_budget_ending_within_an_iteration_are_not_warned_about(tmp_path):
    """The value family counts whole episodes, so its seeds never end on one step (QMIX's
    20,110 and 20,163): within one iteration of each other they are not called stopped; a spread
    of more than an iteration (budgets of 16k and 20k) is."""
    for seed, end in ((1, 20_110), (2, 20_163), (3, 16_020)):
        d = _fake_run(tmp_path / ("short" if seed == 3 else ""), seed, [(end, 0.5)])
        rows = [(i, i * end // 55) for i in (2, 4, 53, 55)]  # ~370 steps an iteration
        lines = ["env_steps,iteration,eval/eval_return_mean"]
        lines += [f"{steps},{i}," for i, steps in rows[:-1]] + [f"{end},55,0.5"]
        (d / "metrics.csv").write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (row,) = report_rows(group_runs(find_runs([tmp_path / "mpe"])), RETURN)
    assert row.seeds == row.complete == 2
    with pytest.warns(UserWarning, match=r"different env steps \(16,020 to 20,163\)"):
        report_rows(group_runs(find_runs([tmp_path])), RETURN)


def test_a_metric_s_typo_gets_the_nearest_column_and_a_summary_name_its_column(tmp_path, capsys):
    """``--metric eval_return_mean`` (the name summary.json and ``mappo train`` use) reads as its
    column; a typo is one line naming the nearest column, without the loss and time columns."""
    d = _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0)])
    text = (d / "metrics.csv").read_text()
    (d / "metrics.csv").write_text(text.replace("\n", ",loss/agents/value_loss\n", 1))
    for name, column in (("eval_return_mean", RETURN), ("train_episode_return", "train/")):
        assert main(["report", str(tmp_path), "--metric", name]) == 0
        assert capsys.readouterr().out.startswith(f"Metric: `{column}")
    (row,) = report_rows(group_runs(find_runs([tmp_path])), "eval_return_mean")
    assert row.metric == RETURN and row.final_mean == -150.0
    for command in ("report", "plot"):
        argv = [command, str(tmp_path), "--metric", "eval/eval_retrun_mean"]
        assert main([*argv, "--out", str(tmp_path / "c.png")] if command == "plot" else argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            "mappo: error: no run logs the column 'eval/eval_retrun_mean'; did you mean "
            f"'{RETURN}'? (the runs' evaluation and training columns: {RETURN}, "
            "train/episode_return)"
        )


def test_a_metric_that_a_configuration_s_runs_never_log_leaves_its_row_out(tmp_path, capsys):
    """Particle-world runs that evaluate but have no win rate will never have one: left out as
    not logging it (they were kept as a row of no seeds "without values yet"), as plot does."""
    _fake_run(tmp_path, 1, [(1000, -200.0)])
    smac = _fake_run(tmp_path, 1, [(1000, 0.5)], preset="smac/3m_fast")
    text = (smac / "metrics.csv").read_text().replace(RETURN, "eval/eval_battle_won")
    (smac / "metrics.csv").write_text(text)
    for argv in (["report"], ["plot", "--out", str(tmp_path / "c.png")]):
        assert main([*argv, str(tmp_path), "--metric", "eval/eval_battle_won"]) == 0
        out, err = capsys.readouterr()
        assert "simple_spread" not in out and "values yet" not in err
        assert (
            "mappo: warning: 'mpe/simple_spread_fast rmappo' does not log 'eval/eval_battle_won'; "
            "left out"
        ) in err


def test_plot_without_a_metric_draws_each_task_s_default(tmp_path, capsys):
    """A StarCraft-style task's win rate and a particle world's return in one plot: each panel
    draws its task's default metric (one metric for all drew only the StarCraft panel)."""
    _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0)])
    smac = _fake_run(tmp_path, 1, [(1000, 0.25), (2000, 0.5)], preset="smac/3m_fast")
    text = (smac / "metrics.csv").read_text().replace(RETURN, "eval/eval_battle_won")
    (smac / "metrics.csv").write_text(text)
    fig = plot_curves(group_runs(find_runs([tmp_path])))
    assert [(ax.get_title(), ax.get_ylabel(), len(ax.lines)) for ax in fig.axes] == [
        ("mpe/simple_spread", RETURN, 1),
        ("smac/3m", "eval/eval_battle_won", 1),
    ]
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
    out, err = capsys.readouterr()
    assert out == (
        f"wrote {tmp_path / 'c.png'}: 2 configurations, metrics {RETURN} (mpe/simple_spread), "
        "eval/eval_battle_won (smac/3m) against env_steps\n"
    )
    assert "does not log" not in err


def test_a_target_over_configurations_of_different_metrics_is_refused(tmp_path, capsys):
    """A level is one metric's: over a win rate and a return (each configuration's default)
    it was applied to both. The table of such rows names each row's metric."""
    _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0)])
    smac = _fake_run(tmp_path, 1, [(1000, 0.25), (2000, 0.5)], preset="smac/3m_fast")
    text = (smac / "metrics.csv").read_text().replace(RETURN, "eval/eval_battle_won")
    (smac / "metrics.csv").write_text(text)
    assert main(["report", str(tmp_path), "--target", "0.5"]) == 2
    assert capsys.readouterr().err == (
        "mappo: error: --target is a level of one metric, but the configurations report "
        f"eval/eval_battle_won and {RETURN}; pass --metric\n"
    )
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| configuration | metric | seeds |" in out
    assert "| smac/3m_fast mappo | eval/eval_battle_won | 1 |" in out
    argv = ["report", str(tmp_path), "--metric", "eval/eval_battle_won", "--target", "0.5"]
    assert main(argv) == 0
    assert "| smac/3m_fast mappo | 1 | 1 / 1 | 2k |" in capsys.readouterr().out


def test_values_that_are_not_finite_are_left_out_with_a_warning(tmp_path):
    """A damaged or foreign metrics.csv with nan or inf evaluations: they are left out (the
    final value is then an earlier evaluation), as before, but no longer silently."""
    d = _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0), (3000, -140.0)])
    text = (d / "metrics.csv").read_text()
    (d / "metrics.csv").write_text(text.replace(",-150.0\n", ",inf\n").replace(",-140.0", ",nan"))
    with pytest.warns(UserWarning) as caught:
        (row,) = report_rows(group_runs(find_runs([tmp_path])), RETURN)
    assert row.final_mean == -200.0
    assert [str(w.message) for w in caught] == [
        f"'{d}' has 2 NaN or infinite values of '{RETURN}' (of 3); left out, so its final value "
        "is its last finite one"
    ]


def test_a_target_over_a_sweep_whose_newest_configuration_has_not_evaluated_yet(tmp_path):
    # Every configuration is a StarCraft map's (the win rate); one has only training rows so
    # far, whose default metric read as the return, and --target was refused as two metrics.
    evaluated = _fake_run(tmp_path, 1, [], preset="smac/3m_fast")
    (evaluated / "metrics.csv").write_text(
        f"env_steps,wall_seconds,train/episode_return,{WIN_RATE}\n"
        "1000,10.0,5.0,0.25\n2000,20.0,8.0,0.75\n",
        encoding="utf-8",
    )
    starting = _fake_run(tmp_path, 1, [], preset="smac/3m_fast", **{"algo.clip": 0.1})
    (starting / "metrics.csv").write_text(
        "env_steps,wall_seconds,train/episode_return\n500,5.0,2.0\n", encoding="utf-8"
    )
    with pytest.warns(UserWarning):  # (the seeds are incomplete; one has no values yet)
        rows = report_rows(group_runs(find_runs([tmp_path])), target=0.5, window=1)
    # the new configuration's row is the win rate's too, with no seed yet
    got = sorted((r.metric, r.seeds, r.reached) for r in rows)
    assert got == [(WIN_RATE, 0, 0), (WIN_RATE, 1, 1)]


def test_a_grid_point_whose_seeds_all_diverged_before_evaluating_gets_its_row(tmp_path, capsys):
    # It said "report again after the first evaluation", which never comes.
    for seed in (1, 2):
        d = _fake_run(tmp_path, seed, [], complete=False)
        with (d / "metrics.csv").open("a", encoding="utf-8") as f:
            f.write("500,5.0,-420.0,\n")  # training rows only
        (d / "error.txt").write_text("TrainingDiverged: training diverged\n", encoding="utf-8")
    assert main(["report", str(tmp_path), "--target", "-120"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 0 / 2 (2 diverged) |" in out and "| 0 / 2 |" in out


def test_text_in_a_number_column_is_named_by_report_and_plot(tmp_path, capsys):
    """A damaged metrics.csv (text where numbers are) used to read as a run that had not
    evaluated yet (report) or as nothing at all (plot drew an empty figure, exit 0)."""
    run = _fake_run(tmp_path, 1, [(1000, -200.0), (2000, -150.0)])
    lines = (run / "metrics.csv").read_text().splitlines()
    lines[2] = "abc" + lines[2][lines[2].index(",") :]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    for argv in (
        ["report", str(tmp_path)],
        ["plot", str(tmp_path), "--out", str(tmp_path / "p.svg")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "has 'abc' in its column 'env_steps' (line 3), which is no number" in err
