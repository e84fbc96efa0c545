"""The ``mappo`` command: its successful paths and every user error (exit 2, one line)."""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mappo.cli import main
from mappo.logging import ProgressBar

TINY = [
    "env.num_envs=4",
    "total_env_steps=300",
    "eval_episodes=2",
    "progress=false",
    "algo.epochs=1",
]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    assert main(["train", "mpe/simple_spread", *TINY, f"run_dir={root}"]) == 0
    (run,) = list(root.glob("mpe/simple_spread/rmappo/*"))
    return run


def test_train_prints_its_result(trained, capsys):
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["env_steps"] == 300 and "eval_return_mean" in summary


def test_every_logged_column_has_a_known_form(trained):
    # A sweep spec's metric is checked against these forms before any trial trains.
    from mappo.logging import is_column_name

    columns = (trained / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "eval/eval_return_mean" in columns
    assert [c for c in columns if not is_column_name(c)] == []


def test_eval_with_gif(trained, tmp_path, capsys):
    gif = tmp_path / "episode.gif"
    code, out, _ = _run(
        capsys, "eval", str(trained), "--episodes", "3", "--gif", str(gif), "--json"
    )
    assert code == 0
    result = json.loads(out)
    assert result["eval_episodes"] == 3 and "eval_occupied_landmarks" in result
    assert result["trained_env_steps"] == 300  # which checkpoint was evaluated
    assert gif.stat().st_size > 1000


def test_a_sampled_eval_repeats_with_its_seed_and_its_gif_samples_too(trained, tmp_path, capsys):
    def sampled(seed: int, gif: Path) -> float:
        argv = ["eval", str(trained), "--episodes", "4", "--sample", "--seed", str(seed)]
        code, out, _ = _run(capsys, *argv, "--gif", str(gif), "--json")
        assert code == 0
        return json.loads(out)["eval_return_mean"]

    first, again = sampled(7, tmp_path / "a.gif"), sampled(7, tmp_path / "b.gif")
    assert first == again and (tmp_path / "a.gif").read_bytes() == (tmp_path / "b.gif").read_bytes()
    code, _, _ = _run(capsys, "eval", str(trained), "--episodes", "1", "--seed", "7", "--gif",
                      str(tmp_path / "greedy.gif"))  # fmt: skip
    assert code == 0  # the GIF plays the way the evaluation played, not greedily
    assert (tmp_path / "greedy.gif").read_bytes() != (tmp_path / "a.gif").read_bytes()


def test_eval_a_checkpoint_file(trained, capsys):
    ckpt = sorted((trained / "checkpoints").glob("*.pt"))[-1]
    code, out, _ = _run(capsys, "eval", str(ckpt), "--episodes", "2")
    assert code == 0 and "eval_return_mean" in out


def test_eval_with_env_parameters_of_the_command_line(trained, tmp_path, capsys):
    # A PettingZoo run trained without render_mode=rgb_array gets its GIF this way; here the
    # particle world's episodes are shortened for the evaluation and its GIF.
    saved = (trained / "config.yaml").read_text()
    gif = tmp_path / "short.gif"
    code, out, _ = _run(
        capsys, "eval", str(trained), "--episodes", "2", "--gif", str(gif), "episode_length=7"
    )
    assert code == 0 and "wrote 7 frames" in out
    code, out, _ = _run(
        capsys, "eval", str(trained), "--episodes", "2", "env.kwargs.episode_length=7"
    )
    assert code == 0 and "eval_return_mean" in out
    assert (trained / "config.yaml").read_text() == saved  # the run keeps its own settings
    code, _, err = _run(capsys, "eval", str(trained), "num_agents=4")
    assert code == 2 and "with num_agents=4 does not fit the networks" in err
    code, _, err = _run(capsys, "eval", str(trained), "algo.epochs=3")
    assert code == 2 and "eval takes the env's parameters only" in err
    code, _, err = _run(capsys, "eval", str(trained), "num_envs=3")
    assert code == 2 and "use --episodes N" in err


def test_eval_draws_a_gif_of_a_pettingzoo_env_that_writes_text(tmp_path, capsys):
    """mpe2's speaker-listener draws its messages as text; closing another copy of it quits
    pygame's fonts, so the GIF's env must not be open while the evaluation's env is closed."""
    pytest.importorskip("mpe2")
    run_dir = tmp_path / "runs"
    code, _, _ = _run(
        capsys, "train", "pettingzoo/simple_spread",
        "env.name=pettingzoo:mpe2.simple_speaker_listener_v4", "env.kwargs.num_workers=0",
        *TINY, "threads=1", f"run_dir={run_dir}",
    )  # fmt: skip
    assert code == 0
    (trained,) = run_dir.glob("*/*/*/*_seed1")
    gif = tmp_path / "sl.gif"
    code, out, err = _run(
        capsys, "eval", str(trained), "--episodes", "2", "--gif", str(gif),
        "render_mode=rgb_array",
    )  # fmt: skip
    assert code == 0, err
    assert "wrote 25 frames" in out and gif.stat().st_size > 0


def test_list_shows_presets_envs_and_keys(capsys):
    code, out, _ = _run(capsys, "list")
    assert code == 0
    assert "mpe/simple_spread_fast" in out and "mpe/simple_reference" in out
    code, out, _ = _run(capsys, "list", "--keys")
    assert "algo.clip = 0.2" in out


def test_bench_train_json(capsys):
    code, out, _ = _run(
        capsys,
        "bench",
        "train",
        "mpe/simple_spread",
        "env.num_envs=4",
        "--iterations",
        "1",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert report["steps_per_second"] > 0 and report["matmul_flop_rate"] > 0
    assert report["update_flops_per_iteration"] > 0
    assert report["preset"] == "mpe/simple_spread" and report["config"] == "rmappo"


def test_an_interrupted_bench_env_prints_the_rows_it_measured(capsys, monkeypatch):
    import mappo.bench.env as bench_env

    calls = []

    def measured_once(name, n, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(n)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return 1000.0

    monkeypatch.setattr(bench_env, "bench_batched", measured_once)
    argv = ["bench", "env", "--num-envs", "1", "8", "--no-pettingzoo", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 130 and "printed the 1 row measured before it" in err
    assert [row["num_envs"] for row in json.loads(out)] == [1]


def test_bench_env_json_rows(capsys):
    code, out, _ = _run(
        capsys, "bench", "env", "--num-envs", "1", "8", "--seconds", "0.05", "--json"
    )
    assert code == 0
    rows = json.loads(out)
    assert [(r["env"], r["num_envs"]) for r in rows] == [
        ("mpe/simple_spread", 1),
        ("mpe/simple_spread", 8),
        ("mpe2", 1),
    ]
    assert all(r["steps_per_second"] > 0 for r in rows)
    import torch

    before = torch.get_num_threads()  # --threads 0: torch's own count, as threads=0 in training
    argv = ["bench", "env", "--num-envs", "8", "--seconds", "0.05", "--no-pettingzoo"]
    assert _run(capsys, *argv, "--threads", "0")[0] == 0 and torch.get_num_threads() == before


def test_bench_env_threads(capsys, monkeypatch):
    """``--threads`` sets torch's threads for our rows only; the process's setting comes back."""
    import torch

    import mappo.bench.env as bench_env

    seen = []
    measure = bench_env.bench_batched

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return measure(*args, **kwargs)

    monkeypatch.setattr(bench_env, "bench_batched", recording)
    before = torch.get_num_threads()
    args = ("bench", "env", "--envs", "hanabi/full-2p", "--num-envs", "4", "--seconds", "0.02")
    code, out, _ = _run(capsys, *args, "--no-pettingzoo", "--threads", "3", "--json")
    assert code == 0 and [r["env"] for r in json.loads(out)] == ["hanabi/full-2p"]
    assert seen == [3] and torch.get_num_threads() == before


def test_bench_env_hanabi_backends(capsys, monkeypatch):
    """``--hanabi-backend torch native``: a row per backend, each env built on it, both compared
    with OpenSpiel's loop where it is installed."""
    import mappo.bench.env as bench_env

    built = []
    measure = bench_env.bench_batched

    def recording(*args, **kwargs):
        built.append(kwargs.get("backend"))
        return measure(*args, **kwargs)

    monkeypatch.setattr(bench_env, "bench_batched", recording)
    args = ("bench", "env", "--envs", "hanabi/full-2p", "--num-envs", "4", "--seconds", "0.02")
    code, out, _ = _run(capsys, *args, "--no-pettingzoo", "--hanabi-backend", "torch", "auto")
    assert code == 0 and built == ["torch", "auto"]
    assert "hanabi/full-2p (torch)" in out and "hanabi/full-2p (auto)" in out
    assert bench_env._reference_of("hanabi/full-4p (native)") == "open_spiel:hanabi-4p"


def test_eval_scripted_baseline(capsys):
    code, out, _ = _run(capsys, "eval", "smac/3m", "--scripted", "--episodes", "4", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["algo"] == "scripted" and 0.0 <= result["eval_battle_won"] <= 1.0
    # named as a trained run's evaluation, so that the two compare line by line
    assert result["eval_episodes"] == 4 and result["eval_return_mean"] > 0
    assert "win_rate" not in result and "mean_return" not in result
    assert list(result)[2:5] == ["eval_return_mean", "eval_return_std", "eval_episodes"]
    code, out, _ = _run(
        capsys, "eval", "hanabi/small-2p", "--scripted", "--episodes", "4", "--json"
    )
    hanabi = json.loads(out)  # the return (the score, or 0 on losing) as a trained run has it
    assert list(hanabi)[2:5] == ["eval_return_mean", "eval_return_std", "eval_episodes"]
    code, _, err = _run(capsys, "eval", "smac/3q", "--scripted")
    assert code == 2 and "unknown SMAC map '3q'" in err


def test_eval_scripted_writes_a_gif_of_one_episode(capsys, tmp_path):
    gif = tmp_path / "scripted.gif"
    code, out, _ = _run(
        capsys, "eval", "smac/3m", "--scripted", "--episodes", "2", "--gif", str(gif)
    )
    assert code == 0 and "frames to" in out and gif.stat().st_size > 0
    # A GIF path that cannot be written is refused before the evaluation, not after it.
    code, out, err = _run(
        capsys, "eval", "smac/3m", "--scripted", "--episodes", "2", "--gif", str(gif) + ".png"
    )
    assert code == 2 and out == "" and "--gif must name a .gif file" in err


def test_render_random_episode(tmp_path, capsys):
    gif = tmp_path / "spread.gif"
    code, out, _ = _run(capsys, "render", "mpe/simple_spread", "--gif", str(gif), "--steps", "5")
    assert code == 0 and gif.exists() and out.strip().endswith("spread.gif")
    # --steps past the end of the 25-step episode: the GIF stops there, and says so
    code, out, _ = _run(capsys, "render", "mpe/simple_spread", "--gif", str(gif), "--steps", "100")
    assert code == 0 and "(the episode ended after 25 of the --steps 100)" in out


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_bad_resume_leaves_the_run_untouched(trained, capsys, tmp_path):
    before = _digest(trained)
    code, _, err = _run(capsys, "train", "--resume", str(trained), "algo.epochs=0")
    assert code == 2 and "'algo.epochs' must be >= 1" in err
    assert _digest(trained) == before


def test_corrupt_checkpoint_is_reported_and_left_alone(trained, capsys, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    code, _, err = _run(capsys, "eval", str(bad))
    assert code == 2 and "not a readable mappo checkpoint" in err
    assert bad.read_bytes() == b"not a checkpoint at all"


def test_console_script_is_installed():
    out = subprocess.run(
        [sys.executable, "-m", "mappo.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "train" in out.stdout


def test_train_given_a_run_directory_says_how_to_resume_it(trained, capsys):
    # (it suggested the nearest preset, which starts a new run from nothing)
    code, _, err = _run(capsys, "train", str(trained), "total_env_steps=600")
    assert code == 2 and err.count("\n") == 1
    assert f"'{trained}' is a run directory" in err
    assert f"mappo train --resume {trained} total_env_steps=600`" in err


def test_resume_command_printed_for_a_folder_with_a_space_pastes_as_one_word(
    trained, tmp_path, capsys
):
    spaced = tmp_path / "my runs" / "spread 1"
    shutil.copytree(trained, spaced)
    code, _, err = _run(capsys, "train", str(spaced), "train.lr=1e-3")
    assert code == 2
    command = err.split("`")[1]
    assert shlex.split(command) == ["mappo", "train", "--resume", str(spaced), "train.lr=1e-3"]


def test_version_names_mappo_torch_and_python(capsys):
    import platform

    import torch

    import mappo

    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    out = capsys.readouterr().out.strip()
    assert stopped.value.code == 0
    assert out == (
        f"mappo {mappo.__version__} (torch {torch.__version__}, Python {platform.python_version()})"
    )


@pytest.mark.parametrize(
    ("argv", "help_of"),
    [
        (["bench", "env", "extra"], "mappo bench env"),
        (["list", "extra"], "mappo list"),
        (["train", "mpe/simple_spread", "--nope"], "mappo train"),
    ],
)
def test_an_unknown_argument_points_at_its_commands_help(capsys, argv, help_of) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2
    assert err == f"mappo: error: unrecognized arguments: {argv[-1]} (see `{help_of} --help`)"


def test_version_reads_torchs_build_from_its_version_file(tmp_path, monkeypatch, capsys):
    # A PyPI wheel's package data says 2.14.1 where torch.__version__ says 2.14.1+cu130: the
    # build comes from torch's version.py, read as text (nothing of it runs).
    import importlib.machinery
    import importlib.util
    from importlib import metadata

    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (fake / "version.py").write_text("__version__ = '9.8.7+cu999'\ncuda = '99.9'\n")
    spec = importlib.machinery.ModuleSpec("torch", None, origin=str(fake / "__init__.py"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: spec if name == "torch" else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "(torch 9.8.7+cu999, Python" in capsys.readouterr().out
    # A version file without the line: the package data's version.
    (fake / "version.py").write_text("cuda = None\n")
    monkeypatch.setattr(metadata, "version", lambda name: "9.8.7")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "(torch 9.8.7, Python" in capsys.readouterr().out


def test_output_to_a_closed_pipe_stops_quietly():
    # `mappo list | head -1`: the reader goes before the output is written ("mappo: error:
    # Broken pipe" and exit 2 before).
    proc = subprocess.Popen(
        [sys.executable, "-m", "mappo.cli", "list", "--keys"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b""


def test_progress_line_past_the_total_shows_no_time_left():
    out = io.StringIO()
    ProgressBar(total=300_000, stream=out).update(300_800, 790.0, -152.8, final=True)
    line = out.getvalue()
    assert "300,800/300,000 steps" in line and "ETA 00:00" in line


def test_progress_line_counts_down_to_a_time_limit_that_comes_first():
    out = io.StringIO()
    # 1,000 of 300,000 steps at 10 steps/s: the budget is 8 hours away, the limit 10 minutes
    ProgressBar(total=300_000, stream=out, time_limit=600.0).update(1_000, 10.0, None)
    assert "stop 09:5" in out.getvalue() or "stop 10:00" in out.getvalue()
    out = io.StringIO()
    ProgressBar(total=300_000, stream=out, time_limit=86_400.0).update(1_000, 10.0, None)
    assert "ETA 8:18:20" in out.getvalue()  # the budget comes first


def test_a_read_only_run_folder_on_resume_names_the_fix_for_a_resume():
    # (a resume cannot "choose a writable place": it writes into the run's own folder)
    import errno

    from mappo.cli import _os_error

    err = OSError(errno.EROFS, "Read-only file system", "runs/x/.lock")
    assert _os_error(err).endswith("; choose a writable place")
    line = _os_error(err, resuming=True)
    assert line.startswith("Read-only file system: 'runs/x/.lock'; a resume writes into")
    assert "copy the run to a writable place and resume the copy" in line


def test_a_full_disk_at_the_first_checkpoint_does_not_promise_a_resume(tmp_path):
    import errno

    from mappo.cli import _os_error

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    first = OSError(errno.ENOSPC, "No space left on device", str(folder / "iter_00000001.pt"))
    assert _os_error(first).endswith("no checkpoint yet: free space and start it again")
    (folder / "iter_00000001.pt").write_bytes(b"")
    later = OSError(errno.ENOSPC, "No space left on device", str(folder / "iter_00000002.pt"))
    assert _os_error(later).endswith("those written before are intact: free space and resume")


def test_out_of_memory_names_what_the_command_can_lower():
    from argparse import Namespace

    from mappo.cli import _memory_fix

    render = Namespace(command="render", kwargs=["num_agents=1000000"])
    assert _memory_fix(render) == "lower the env parameters given (num_agents=1000000)"
    evaluation = Namespace(command="eval", kwargs=["num_agents=9"], episodes=1)
    assert _memory_fix(evaluation) == "lower --episodes or the env parameters given (num_agents=9)"
    assert _memory_fix(Namespace(command="eval", kwargs=[])) == "lower --episodes"


def test_a_full_disk_in_tensorboard_s_writer_thread_prints_no_traceback(capsys) -> None:
    """The command's own thread reports the error at its next write, in one line."""
    import threading

    from mappo.cli import _quiet_writer_errors

    writer = type("_AsyncWriterThread", (threading.Thread,), {"__module__": "tensorboard.w"})
    err = OSError(28, "No space left on device")
    seen = []
    _quiet_writer_errors(threading.ExceptHookArgs([OSError, err, None, writer()]), seen.append)
    assert seen == []
    other = threading.ExceptHookArgs([OSError, err, None, threading.Thread()])
    _quiet_writer_errors(other, seen.append)
    assert seen == [other]  # other threads' errors go to the hook installed before
    # main() leaves the caller's hooks as they were
    before = threading.excepthook, warnings.showwarning
    assert main(["list"]) == 0
    assert (threading.excepthook, warnings.showwarning) == before
    capsys.readouterr()


def test_warnings_are_shown_without_terminal_colours(capsys):
    # Gymnasium colours its warnings' text; on one line in a log the codes read as noise
    from mappo.cli import _show_warning

    _show_warning("\x1b[33mWARN: env.seed is deprecated\x1b[0m", UserWarning, "f.py", 1)
    assert capsys.readouterr().err == "mappo: warning: WARN: env.seed is deprecated\n"
