"""Sweeps: specs, trials on local Ray and serially, skipping, resuming after kill -9, failing
trials, and a two-node Ray cluster on this machine."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from mappo import config as C
from mappo.cli import main
from mappo.experiments import sweep as S
from mappo.trainer import train

# A run of a few hundred env steps: 4 envs x 5 steps per update, evaluated every 2 updates.
TINY_PRESET = """\
env: {name: mpe/simple_spread, num_envs: 4}
rollout_length: 5
total_env_steps: 200
model: {hidden_sizes: [16], recurrent: none}
algo: {epochs: 1, num_minibatches: 1}
eval_interval: 2
eval_episodes: 2
log_interval: 1
checkpoint_interval: 2
tensorboard: false
"""
# Columns that depend on the machine's speed, not on what was learned.
TIMING = ("wall_seconds", "steps_per_second", "threads", "time/")


def _write_spec(tmp: Path, body: str) -> Path:
    (tmp / "tiny.yaml").write_text(TINY_PRESET)
    spec = tmp / "spec.yaml"
    spec.write_text(body.replace("TINY", str(tmp / "tiny.yaml")))
    return spec


def _learned(run_dir: Path) -> list[dict[str, str]]:
    with (Path(run_dir) / "metrics.csv").open() as f:
        return [
            {k: v for k, v in row.items() if not k.startswith(TIMING)} for row in csv.DictReader(f)
        ]


def _start_sweep(
    tmp: Path, body: str, backend: str, sigint_ignored: bool = False
) -> tuple[Path, S.SweepSpec, subprocess.Popen]:
    """``mappo sweep`` of the tiny preset (``body`` adds seeds and overrides) in a child process
    writing to ``tmp/sw``, with stderr captured; returns the spec file, the spec and the process.
    ``sigint_ignored``: the child starts with SIGINT ignored, as a background job of a
    non-interactive shell does."""
    spec_path = _write_spec(tmp, "presets: [TINY]\n" + body)
    spec = S.load_spec(str(spec_path), tmp / "sw")
    cmd = [sys.executable, "-m", "mappo.cli", "sweep", str(spec_path), "--dir", str(tmp / "sw")]

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        cmd + ["--backend", backend],
        stdout=(tmp / "sweep.out").open("w", encoding="utf-8"),  # the status lines
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_sigint if sigint_ignored else None,
    )
    return spec_path, spec, proc


def _wait_for_checkpoint(proc: subprocess.Popen, trial_dir: Path, timeout: float = 180) -> None:
    """Poll (every 20 ms) until the running sweep ``proc`` wrote a checkpoint in ``trial_dir``."""
    deadline = time.monotonic() + timeout
    while not list((trial_dir / "checkpoints").glob("iter_*.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


def _summaries(spec: S.SweepSpec) -> list[dict]:
    return [json.loads((Path(t.dir) / "summary.json").read_text()) for t in spec.trials]


def test_spec_expands_the_grid_and_checks_every_trial(tmp_path):
    path = _write_spec(
        tmp_path,
        "presets: [TINY, mpe/simple_spread_fast]\nseeds: 2\n"
        "grid: {algo.clip: [0.1, 0.2], model.hidden_sizes: [[8], [16, 16]]}\n"
        "overrides: {total_env_steps: 400}\nresources: {cpus: 2}\n",
    )
    spec = S.load_spec(str(path), tmp_path / "sw")
    assert len(spec.trials) == 2 * 2 * 2 * 2
    ids = [t.id for t in spec.trials]
    assert ids[0] == "tiny/algo.clip=0.1,model.hidden_sizes=8/seed1"
    assert "mpe/simple_spread_fast/algo.clip=0.2,model.hidden_sizes=16_16/seed2" in ids
    assert len(set(ids)) == len(ids)
    trial = spec.trials[-1]
    assert trial.overrides["threads"] == 2 and trial.overrides["progress"] is False
    assert trial.total_env_steps == 400 and trial.root == (tmp_path / "sw").resolve()
    cfg = C.load(trial.preset, trial.overrides)
    assert cfg.algo.clip == 0.2 and cfg.model.hidden_sizes == [16, 16] and cfg.seed == 2


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "presets: [TINY]\ngrd: {algo.clip: [0.1]}\n",
            "did you mean 'grid'?",
        ),
        ("presets: []\n", "'presets' in"),
        ("presets: [TINY]\nseeds: [1, 1]\n", "distinct"),
        ("presets: [TINY]\ngrid: {algo.clip: 0.1}\n", "non-empty lists"),
        ("presets: [TINY]\ngrid: {algo.clp: [0.1]}\n", "did you mean 'algo.clip'?"),
        ("presets: [TINY]\noverrides: {algo.clip: -1}\n", "trial tiny/default/seed1"),
        ("presets: [mpe/simple_sprd]\n", "did you mean"),
        ("presets: [TINY]\ngrid: {seed: [1, 2]}\n", "seeds:"),
        ("presets: [TINY]\nresources: {cpus: 1, gpus: 1}\n", "device: cuda"),
        ("presets: [TINY]\noverrides: {num_seeds: 2}\n", "under 'seeds'"),
        ("presets: [TINY]\nresources: {cpu: 1}\n", "unknown resource 'cpu'"),
        ("presets: [TINY\n", "not valid YAML"),
        ("presets: [TINY, TINY]\n", "would share the folder 'tiny/default/seed1'"),
        ("presets: [TINY]\ngrid: {algo.clip: [0.1, 0.10]}\n", "would share the folder"),
        ("presets: [TINY]\ngrid: {name: ['" + "x" * 300 + "']}\n", "too long"),
        ("presets: [TINY]\nmetric: eval_return_mean\n", "did you mean 'eval/eval_return_mean'?"),
        ("presets: [TINY]\nmetric: score\n", "is 'score', which no run logs (columns of"),
        # (names of the right form that the sweep's envs do not log: a typo, another env's)
        (
            "presets: [TINY]\nmetric: eval/eval_retrun_mean\n",
            "none of the sweep's envs logs; did you mean 'eval/eval_return_mean'?",
        ),
        ("presets: [TINY]\nmetric: eval/eval_battle_won\n", "(they log eval/eval_collisions,"),
        (
            "presets: [TINY]\ngrid: {env.name: [mpe/simple_sprad]}\n",
            "unknown environment 'mpe/simple_sprad'; did you mean 'mpe/simple_spread'?",
        ),
    ],
)
def test_bad_specs_are_one_line_errors(tmp_path, capsys, body, message):
    spec = _write_spec(tmp_path, body)
    assert main(["sweep", str(spec), "--dir", str(tmp_path / "sw"), "--backend", "serial"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mappo: error: ") and "\n" not in err
    assert message in err
    assert not (tmp_path / "sw").exists()  # nothing written


def test_a_metric_one_of_the_sweeps_envs_logs_is_taken(tmp_path):
    spec = _write_spec(
        tmp_path,
        "presets: [TINY]\ngrid: {env.name: [mpe/simple_spread, smac/3m]}\n"
        "metric: eval/eval_battle_won\n",
    )
    assert len(S.load_spec(str(spec), tmp_path / "sw").trials) == 2


def test_unknown_shipped_spec_names_the_nearest(capsys):
    assert main(["sweep", "paper/mpee", "--dry-run"]) == 2
    assert "did you mean 'paper/mpe'?" in capsys.readouterr().err


def test_shipped_specs_load(tmp_path):
    for name in S.list_specs():
        spec = S.load_spec(name, tmp_path / name)
        assert spec.trials and len({t.id for t in spec.trials}) == len(spec.trials)
    assert len(S.load_spec("paper/mpe", tmp_path / "p").trials) == 9 * 3


def test_ray_sweep_runs_every_trial_and_a_rerun_skips_them(tmp_path, capsys):
    pytest.importorskip("ray")
    spec_path = _write_spec(
        tmp_path, "presets: [TINY]\nseeds: [1, 2]\ngrid: {algo.clip: [0.1, 0.3]}\n"
    )
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "ray"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    assert [s["env_steps"] for s in _summaries(spec)] == [200] * 4
    status = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert status["backend"] == "ray" and [t["status"] for t in status["trials"]] == ["done"] * 4
    assert (tmp_path / "sw" / "report.md").is_file() and (tmp_path / "sw" / "curves.png").is_file()
    assert "algo.clip=0.1 | 2 |" in out and "algo.clip=0.3 | 2 |" in out  # report: 2 seeds each
    # Each trial learned what the same run trained on its own learns.
    single = train(
        C.load(spec.trials[3].preset, spec.trials[3].overrides), run_dir=tmp_path / "one"
    )
    assert _learned(single.dir) == _learned(Path(spec.trials[3].dir))

    before = {t.id: (Path(t.dir) / "metrics.csv").stat().st_mtime_ns for t in spec.trials}
    assert main(argv) == 0
    assert "4 finished before, 0 to run" in capsys.readouterr().out
    after = {t.id: (Path(t.dir) / "metrics.csv").stat().st_mtime_ns for t in spec.trials}
    assert after == before
    status = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [t["status"] for t in status["trials"]] == ["skipped"] * 4


def test_a_failing_trial_is_reported_and_the_others_finish(tmp_path, capsys):
    spec_path = _write_spec(
        tmp_path, "presets: [TINY]\nseeds: [1]\ngrid: {env.kwargs.num_agents: [2, 0, 3]}\n"
    )
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    bad = spec.trials[1]
    assert "tiny/env.kwargs.num_agents=0/seed1 failed: EnvError" in captured.err
    assert "1 of 3 trials failed" in captured.err
    assert "Traceback" in (Path(bad.dir) / "error.txt").read_text()
    for good in (spec.trials[0], spec.trials[2]):
        assert json.loads((Path(good.dir) / "summary.json").read_text())["env_steps"] == 200
    status = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [t["status"] for t in status["trials"]] == ["done", "failed", "done"]
    assert "EnvError" in status["trials"][1]["error"]
    # It failed before its first row, yet the report counts it as its configuration's seed.
    assert (Path(bad.dir) / "config.yaml").is_file()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "sw")]) == 0
    out = capsys.readouterr().out
    assert (
        "| mpe/simple_spread mappo env.kwargs.num_agents=0 | 0 | 0 / 1 (1 failed) | - | - |" in out
    )
    # A re-run retries only the failed trial (which fails again, the same way).
    assert main(argv) == 1
    assert "2 finished before, 1 to run" in capsys.readouterr().out


def test_a_sweep_writes_text_as_utf8_under_a_locale_that_cannot_encode_it(tmp_path):
    # Windows opens text files in cp1252 unless told otherwise; an ASCII locale imitates it.
    spec_path = _write_spec(
        tmp_path,
        "presets: [TINY]\nseeds: [1]\ndescription: entropy \u03bb \u2265 0\n"
        "grid: {env.kwargs.num_agents: [2, 0]}\n",
    )
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "mappo.cli", "sweep", str(spec_path), "--dir", str(tmp_path / "sw")]
        + ["--backend", "serial"],
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
    )
    # one trial fails (no agents), the other finishes; neither write raises
    assert out.returncode == 1 and "1 of 2 trials failed" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    report = (tmp_path / "sw" / "report.md").read_text(encoding="utf-8")
    assert "entropy \u03bb \u2265 0" in report
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    assert "EnvError" in (Path(spec.trials[1].dir) / "error.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("stack", [False, True])
def test_a_signal_in_a_trials_last_iteration_still_stops_the_serial_sweep(
    tmp_path, capsys, monkeypatch, stack
):
    # The trial finished (its last iteration was under way), but the sweep had said it was
    # stopping: it went on to the next trial, where a second Ctrl-C counted as a first.
    import mappo.trainer

    finish = mappo.trainer.Trainer.finish

    def signalled_while_finishing(self):
        self.stop_signal = signal.SIGINT  # what the handler records
        return finish(self)

    monkeypatch.setattr(mappo.trainer.Trainer, "finish", signalled_while_finishing)
    spec_path = _write_spec(
        tmp_path, "presets: [TINY]\nseeds: [1, 2]\ngrid: {algo.clip: [0.1, 0.2]}\n"
    )
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    argv += ["--stack-seeds" if stack else "--no-stack-seeds"]
    assert main(argv) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "mappo: sweep interrupted" in err, err
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    finished = [(Path(t.dir) / "summary.json").exists() for t in spec.trials]
    assert finished == ([True, True, False, False] if stack else [True, False, False, False])
    monkeypatch.setattr(mappo.trainer.Trainer, "finish", finish)
    assert main(argv) == 0  # the rerun trains the rest
    assert all((Path(t.dir) / "summary.json").exists() for t in spec.trials)


def test_a_killed_sweep_resumes_from_checkpoints(tmp_path):
    """kill -9 of a serial sweep mid-trial, then the same command: every trial finishes, and the
    interrupted one learned exactly what an uninterrupted run learns."""
    spec_path, spec, proc = _start_sweep(
        tmp_path,
        "seeds: [1, 2]\n"
        "overrides: {total_env_steps: 6000, checkpoint_interval: 5, eval_interval: 10}\n",
        "serial",
    )
    sweep_dir = tmp_path / "sw"
    first = Path(spec.trials[0].dir)
    _wait_for_checkpoint(proc, first)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (first / "summary.json").exists(), "the trial finished before it was killed"
    assert S.trial_state(spec.trials[0]) == "partial"
    assert main(["sweep", str(spec_path), "--dir", str(sweep_dir), "--backend", "serial"]) == 0
    assert [s["env_steps"] for s in _summaries(spec)] == [6000, 6000]
    single = train(C.load(spec.trials[0].preset, spec.trials[0].overrides), run_dir=tmp_path / "u")
    assert _learned(single.dir) == _learned(first)


def test_trials_with_a_time_limit_advance_a_slice_per_sweep_run(tmp_path, capsys):
    """max_wall_seconds among the overrides: each run of the sweep trains every trial for one
    slice (here one iteration), and the next run resumes them, to the budget and to what an
    uninterrupted run learns."""
    spec_path = _write_spec(
        tmp_path,
        "presets: [TINY]\nseeds: [1]\noverrides: {max_wall_seconds: 1.0e-6, threads: 1}\n",
    )
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    (trial,) = spec.trials
    steps = []
    for _ in range(10):
        assert main(argv) == 0
        steps.append(json.loads((Path(trial.dir) / "summary.json").read_text())["env_steps"])
        if steps[-1] >= 200:
            break
    capsys.readouterr()
    assert steps == list(range(20, 220, 20))  # one 20-step iteration per run of the sweep
    assert S.trial_state(trial) == "finished" and main(argv) == 0  # then it is skipped
    over = {**trial.overrides, "max_wall_seconds": 0}
    single = train(C.load(trial.preset, over), run_dir=tmp_path / "u")
    sliced, whole = _learned(trial.dir), _learned(single.dir)
    assert [r["env_steps"] for r in sliced] == [r["env_steps"] for r in whole]
    for a, b in zip(sliced, whole, strict=True):
        # every slice ends with an evaluation; those of the uninterrupted run's schedule (every
        # second iteration) draw its seeds and give its numbers
        scheduled = int(b["iteration"]) % 2 == 0
        assert {k: v for k, v in a.items() if scheduled or not k.startswith("eval/")} == {
            k: v for k, v in b.items() if scheduled or not k.startswith("eval/")
        }
        assert a["eval/eval_return_mean"] != ""


@pytest.fixture
def two_node_cluster(tmp_path):
    """A head node and a second node on the loopback address, one CPU each, on this machine.

    Each node is a ``ray start --block`` process, which takes its node's processes down when it
    is stopped: tearing down never touches other Ray instances on the machine (``ray stop``
    would stop every one, a running sweep's included)."""
    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        ray_bin = Path(shutil.which("ray") or "ray")
    env = {**os.environ, "RAY_worker_niceness": "0", "RAY_AUTH_MODE": "disabled"}
    port = "6397"
    common = ["--num-cpus=1", "--disable-usage-stats", "--block"]
    head = [str(ray_bin), "start", "--head", f"--port={port}", "--include-dashboard=false"]
    second = [str(ray_bin), "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1"]
    nodes = []
    try:
        for argv in (head, second):
            nodes.append(
                subprocess.Popen(
                    argv + common, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
            _wait_for_nodes(f"127.0.0.1:{port}", len(nodes), env)
        yield f"127.0.0.1:{port}", env
    finally:
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()


def _wait_for_nodes(address: str, count: int, env: dict[str, str], timeout: float = 120) -> None:
    """Wait until the cluster at ``address`` reports ``count`` alive nodes."""
    probe = (
        f"import ray; ray.init(address={address!r}, log_to_driver=False); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(1)
    raise AssertionError(f"the Ray cluster at {address} did not reach {count} nodes")


def test_a_sweep_spreads_trials_across_two_ray_nodes(tmp_path, two_node_cluster, monkeypatch):
    address, env = two_node_cluster
    monkeypatch.setenv("RAY_AUTH_MODE", env["RAY_AUTH_MODE"])
    spec_path = _write_spec(
        tmp_path,
        "presets: [TINY]\nseeds: [1, 2, 3, 4]\noverrides: {total_env_steps: 2000}\n",
    )
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--address", address]
    assert main(argv) == 0
    status = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [t["status"] for t in status["trials"]] == ["done"] * 4
    assert len({t["node"] for t in status["trials"]}) == 2


def _ctrl_c_a_ray_sweep(
    tmp_path: Path, seeds: str, sigint_ignored: bool = False
) -> tuple[Path, S.SweepSpec, dict]:
    """Start a Ray sweep of the tiny preset (``seeds`` adds its seed lines), press Ctrl-C once
    its last trial checkpointed, check the exit and message; returns the spec file, the spec and
    the sweep's ``sweep.json``."""
    pytest.importorskip("ray")
    spec_path, spec, proc = _start_sweep(
        tmp_path,
        seeds + "overrides: {total_env_steps: 16000, checkpoint_interval: 20, eval_interval: 50}\n",
        "ray",
        sigint_ignored,
    )
    _wait_for_checkpoint(proc, Path(spec.trials[-1].dir))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "run `mappo sweep" in err and "again to continue" in err
    # the console says which trials stopped, as the serial backend's does
    said = (tmp_path / "sweep.out").read_text(encoding="utf-8")
    assert f"{spec.trials[-1].id}: interrupted" in said, said
    return spec_path, spec, json.loads((tmp_path / "sw" / "sweep.json").read_text())


def test_ctrl_c_stops_a_ray_sweep_with_checkpoints_and_a_rerun_resumes(tmp_path):
    # started with SIGINT ignored (a background job of a script): the sweep still stops on it
    spec_path, spec, status = _ctrl_c_a_ray_sweep(tmp_path, "seeds: [1]\n", sigint_ignored=True)
    sweep_dir = tmp_path / "sw"
    assert status["trials"][0]["status"] == "interrupted"
    assert S.trial_state(spec.trials[0]) == "partial"  # it checkpointed on the way out
    assert main(["sweep", str(spec_path), "--dir", str(sweep_dir), "--backend", "serial"]) == 0
    assert _summaries(spec)[0]["env_steps"] == 16000


def test_cli_refuses_bad_addresses_and_counts_in_one_line(tmp_path, capsys):
    spec = _write_spec(tmp_path, "presets: [TINY]\n")
    base = ["sweep", str(spec), "--dir", str(tmp_path / "sw")]
    for extra, message in [
        (["--backend", "ray", "--address", "not a host"], "must be 'auto' or HOST:PORT"),
        (["--max-concurrent", "-1"], "must be an integer >= 0, got -1"),
        (["--backend", "serial", "--address", "auto"], "needs the ray backend"),
    ]:
        try:
            code = main(base + extra)
        except SystemExit as exit_:  # argparse's own errors exit from the parser
            code = exit_.code
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mappo: error: ") and "\n" not in err and message in err
        assert len(err) < 300


def test_a_changed_spec_is_refused_and_a_second_sweep_on_one_folder_too(tmp_path, capsys):
    spec_path = _write_spec(tmp_path, "presets: [TINY]\noverrides: {algo.clip: 0.2}\n")
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    assert main(argv) == 0
    trial_dir = Path(S.load_spec(str(spec_path), tmp_path / "sw").trials[0].dir)
    before = (trial_dir / "metrics.csv").read_bytes()
    capsys.readouterr()
    assert main([*argv, "--dry-run"]) == 0
    assert f"{trial_dir}  (finished, skipped)" in capsys.readouterr().out
    spec_path.write_text(spec_path.read_text().replace("0.2", "0.3"))
    for extra in (["--dry-run"], []):  # the dry run gives the refusal the sweep would
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert "was trained with algo.clip=0.2 but the spec now gives 0.3" in err
    # A larger budget is not a different configuration: the trial resumes to it.
    spec_path.write_text(
        spec_path.read_text().replace("algo.clip: 0.3", "algo.clip: 0.2, total_env_steps: 400")
    )
    from mappo.trainer import hold_lock

    assert main([*argv, "--dry-run"]) == 0
    assert f"{trial_dir}  (resumes from its checkpoint)" in capsys.readouterr().out
    with hold_lock((tmp_path / "sw").resolve(), "sweep"):
        assert main(argv) == 2
    assert "sweep" in capsys.readouterr().err and (trial_dir / "metrics.csv").read_bytes() == before
    assert main(argv) == 0
    assert json.loads((trial_dir / "summary.json").read_text())["env_steps"] == 400


def test_a_new_budget_for_a_trial_whose_learning_rate_decays_over_it_is_refused(tmp_path, capsys):
    # With algo.lr_decay the budget is the schedule's length: extending a finished trial would
    # restart a learning rate that had decayed to zero, and a report would pool two schedules.
    body = "presets: [TINY]\noverrides: {algo.lr_decay: true, total_env_steps: 200}\n"
    spec_path = _write_spec(tmp_path, body)
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    assert main(argv) == 0
    spec_path.write_text(spec_path.read_text().replace("200", "400"))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "decays its learning rates to zero over total_env_steps=200" in err, err
    assert "spec now gives 400" in err and "new --dir" in err
    from mappo.experiments.runs import setting_items

    config = {"algo.lr_decay": True, "total_env_steps": 200, "seed": 1}
    assert setting_items(config) == [("algo.lr_decay", "True"), ("total_env_steps", "200")]
    assert setting_items({**config, "algo.lr_decay": False}) == [("algo.lr_decay", "False")]


def test_a_trial_written_before_a_config_key_existed_continues(tmp_path, capsys):
    """A sweep started with an older version (its trials' config.yaml lack keys added since,
    here ``compile``) continues under this one: a missing key counts as its default."""
    spec_path = _write_spec(tmp_path, "presets: [TINY]\n")
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    assert main(argv) == 0
    trial_dir = Path(S.load_spec(str(spec_path), tmp_path / "sw").trials[0].dir)
    saved = yaml.safe_load((trial_dir / "config.yaml").read_text())
    del saved["compile"]
    (trial_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    # Compiled and eager runs of one configuration are grouped together too.
    from mappo.experiments.runs import BOOKKEEPING_KEYS

    assert "compile" in BOOKKEEPING_KEYS


def test_a_trial_killed_between_its_last_checkpoint_and_its_summary_counts_as_finished(tmp_path):
    spec_path = _write_spec(tmp_path, "presets: [TINY]\n")
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    assert main(argv) == 0
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    (Path(spec.trials[0].dir) / "summary.json").unlink()
    assert S.trial_state(spec.trials[0]) == "partial"
    assert main(argv) == 0
    assert S.trial_state(spec.trials[0]) == "finished"
    status = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert status["trials"][0]["status"] == "skipped"


def test_capacity_is_counted_node_by_node():
    nodes = [
        {"Alive": True, "Resources": {"CPU": 1.0}},
        {"Alive": True, "Resources": {"CPU": 3.0, "GPU": 1.0}},
        {"Alive": False, "Resources": {"CPU": 8.0}},
    ]
    assert S._trials_that_fit(nodes, 1.0, 0.0) == 4
    assert S._trials_that_fit(nodes, 2.0, 0.0) == 1  # 1 + 3 CPUs do not make a 2-CPU slot twice
    assert S._trials_that_fit(nodes, 1.0, 0.5) == 2


def test_status_table_shows_steps_returns_and_evaluations(tmp_path):
    spec = S.load_spec(str(_write_spec(tmp_path, "presets: [TINY]\nseeds: [1, 2]\n")), tmp_path)
    first = Path(spec.trials[0].dir)
    first.mkdir(parents=True)
    (first / "metrics.csv").write_text(
        "env_steps,train/episode_return,eval/eval_return_mean\n20,-180.5,\n40,-170.25,-150.125\n"
    )

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    table = S.StatusTable(spec.trials, out)
    table.set(spec.trials[0].id, "running")
    table.refresh()
    table.refresh()
    lines = out.getvalue().split("\n")
    assert "tiny/default/seed1  running" in lines[1] and "40/200" in lines[1]
    assert "-170.25" in lines[1] and "-150.12" in lines[1]
    assert "tiny/default/seed2  pending" in lines[2]
    assert "\x1b[3F" in out.getvalue()  # the second refresh redraws the 3 lines in place


def _numbers(rows: list[dict[str, str]]) -> list[list[float]]:
    return [[float(v) for k, v in sorted(r.items()) if v not in ("", None)] for r in rows]


@pytest.fixture
def stacked_calls(monkeypatch) -> list[tuple[list[int], bool]]:
    """Each stacked run this process starts, as (its seeds, whether it resumed)."""
    import mappo.trainer as T

    calls: list[tuple[list[int], bool]] = []
    real = T._run_stacked

    def counting(cfgs, checkpoints, **kwargs):
        calls.append(([c.seed for c in cfgs], checkpoints is not None))
        return real(cfgs, checkpoints, **kwargs)

    monkeypatch.setattr(T, "_run_stacked", counting)
    return calls


def test_stack_seeds_trains_each_configurations_seeds_in_one_process(
    tmp_path, stacked_calls, capsys
):
    """With stack_seeds, the new seeds of each preset and grid point train together (one
    stacked run per configuration, any seeds), a finished trial is skipped, and every trial
    still gets its own ordinary folder, learning what its single run learns."""
    calls = stacked_calls
    sweep_dir = tmp_path / "sw"
    before = _write_spec(tmp_path, "presets: [TINY]\nseeds: [2]\ngrid: {algo.clip: [0.1]}\n")
    assert main(["sweep", str(before), "--dir", str(sweep_dir), "--backend", "serial"]) == 0
    assert calls == []  # unstacked: an ordinary run
    body = "presets: [TINY]\nseeds: [1, 2, 3]\ngrid: {algo.clip: [0.1, 0.3]}\nstack_seeds: true\n"
    spec_path = _write_spec(tmp_path, body)
    argv = ["sweep", str(spec_path), "--dir", str(sweep_dir), "--backend", "serial"]
    capsys.readouterr()
    assert main([*argv, "--dry-run"]) == 0
    listing = capsys.readouterr().out
    # as the sweep will run them: the finished seed is not counted among those stacked
    assert listing.count("together in one process (3 seeds):") == 1
    assert listing.count("together in one process (2 seeds):") == 1
    assert "  tiny/algo.clip=0.3/seed2  " in listing
    assert listing.count("(new)") == 5 and listing.count("(finished, skipped)") == 1
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "6 trials, 1 finished before, 5 to run on serial (2 processes, seeds stacked)" in out
    assert calls == [([1, 3], False), ([1, 2, 3], False)]
    spec = S.load_spec(str(spec_path), sweep_dir)
    assert [s["env_steps"] for s in _summaries(spec)] == [200] * 6
    for t in spec.trials:
        saved = yaml.safe_load((Path(t.dir) / "config.yaml").read_text())
        assert saved["seed"] == t.overrides["seed"] and saved["num_seeds"] == 1
    status = json.loads((sweep_dir / "sweep.json").read_text())
    assert [t["status"] for t in status["trials"]] == ["done", "skipped"] + ["done"] * 4
    # A stacked trial learned what its single run learns (to float rounding: batched matmuls).
    single = train(C.load(spec.trials[5].preset, spec.trials[5].overrides), run_dir=tmp_path / "u")
    got, want = _numbers(_learned(Path(spec.trials[5].dir))), _numbers(_learned(single.dir))
    assert len(got) == len(want) and got[-1] == pytest.approx(want[-1], rel=1e-3, abs=1e-4)
    assert main(argv) == 0
    assert "6 finished before, 0 to run" in capsys.readouterr().out


def test_value_family_trials_are_not_stacked(tmp_path):
    path = _write_spec(tmp_path, "presets: [TINY, smac/3m_qmix_fast]\nseeds: [1, 2]\n")
    spec = S.load_spec(str(path), tmp_path / "sw")
    units = S.plan_units(spec.trials, stack_seeds=True)
    assert [[t.id for t in u] for u in units] == [
        ["tiny/default/seed1", "tiny/default/seed2"],
        ["smac/3m_qmix_fast/default/seed1"],
        ["smac/3m_qmix_fast/default/seed2"],
    ]
    assert len(S.plan_units(spec.trials, stack_seeds=False)) == 4
    bad = _write_spec(tmp_path, "presets: [TINY]\nstack_seeds: 2\n")
    with pytest.raises(S.SweepError, match="'stack_seeds' in .* must be true or false"):
        S.load_spec(str(bad), tmp_path / "sw")


def test_a_stacked_ray_sweep_stops_on_ctrl_c_and_its_seeds_resume_together(tmp_path, stacked_calls):
    pytest.importorskip("ray")
    import mappo.trainer as T
    from mappo.checkpoint import load_latest

    spec_path, spec, status = _ctrl_c_a_ray_sweep(tmp_path, "seeds: [1, 2]\nstack_seeds: true\n")
    sweep_dir = tmp_path / "sw"
    assert [t["status"] for t in status["trials"]] == ["interrupted", "interrupted"]
    assert status["trials"][0]["seconds"] == status["trials"][1]["seconds"]  # one process
    assert [S.trial_state(t) for t in spec.trials] == ["partial", "partial"]
    iterations = {load_latest(t.dir)[1]["progress"]["iteration"] for t in spec.trials}
    assert len(iterations) == 1  # both seeds checkpointed at the same iteration
    argv = ["sweep", str(spec_path), "--dir", str(sweep_dir), "--backend", "serial"]
    assert main(argv) == 0  # the spec asks for stacking: no flag needed
    assert stacked_calls == [([1, 2], True)]
    assert [s["env_steps"] for s in _summaries(spec)] == [16000, 16000]
    # The resumed seeds end where the uninterrupted stacked run ends.
    cfgs = [C.load(t.preset, t.overrides) for t in spec.trials]
    straight = T.train_stacked(cfgs, [tmp_path / "a", tmp_path / "b"])
    for t, run in zip(spec.trials, straight, strict=True):
        got = load_latest(t.dir)[1]["learner"]["policy"]
        for name, value in run.policy.state_dict().items():
            assert torch.allclose(got[name], value, atol=2e-5), name


def test_stacked_seeds_resume_in_groups_of_equal_iteration(tmp_path, stacked_calls):
    """Seeds 1 and 2 stopped at one iteration resume together, seed 3 (elsewhere) alone, new
    seed 4 alone: a unit splits by what each trial's folder holds."""
    sweep_dir = tmp_path / "sw"

    def sweep(seeds: str, steps: int, stack: bool) -> int:
        body = f"presets: [TINY]\nseeds: {seeds}\noverrides: {{total_env_steps: {steps}}}\n"
        spec = _write_spec(tmp_path, body + f"stack_seeds: {str(stack).lower()}\n")
        return main(["sweep", str(spec), "--dir", str(sweep_dir), "--backend", "serial"])

    assert sweep("[1, 2]", 100, stack=False) == 0 and sweep("[3]", 60, stack=False) == 0
    assert stacked_calls == []
    assert sweep("[1, 2, 3, 4]", 200, stack=True) == 0
    assert stacked_calls == [([1, 2], True)]
    spec = S.load_spec(str(tmp_path / "spec.yaml"), sweep_dir)
    assert [s["env_steps"] for s in _summaries(spec)] == [200] * 4


def test_a_stack_that_fails_runs_its_trials_one_by_one(tmp_path, monkeypatch, capsys):
    import mappo.trainer as T

    def broken(cfgs, checkpoints, run_dirs=None):
        raise RuntimeError("out of memory for 2 seeds")

    monkeypatch.setattr(T, "_run_stacked", broken)
    spec_path = _write_spec(tmp_path, "presets: [TINY]\nseeds: [1, 2]\n")
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    assert main([*argv, "--stack-seeds"]) == 0
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    assert [s["env_steps"] for s in _summaries(spec)] == [200, 200]
    assert not any((Path(t.dir) / "error.txt").exists() for t in spec.trials)
    status = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [t["status"] for t in status["trials"]] == ["done", "done"]
    capsys.readouterr()
    # --no-stack-seeds turns a spec's stacking off: nothing is grouped.
    stacked = _write_spec(tmp_path, "presets: [TINY]\nseeds: [1, 2]\nstack_seeds: true\n")
    assert main(["sweep", str(stacked), "--dry-run", "--no-stack-seeds"]) == 0
    assert "together" not in capsys.readouterr().out
    assert main(["sweep", str(stacked), "--dry-run"]) == 0
    assert "together in one process (2 seeds)" in capsys.readouterr().out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_stack_run_one_by_one_before_its_next_seed(
    tmp_path, monkeypatch, capsys, signum
):
    # A stack that failed runs its seeds one at a time; a signal in the first one's last
    # iteration must stop the sweep there, not train the second seed in full.
    import mappo.trainer as T

    def broken(cfgs, checkpoints, run_dirs=None):
        raise RuntimeError("out of memory for 2 seeds")

    finish = T.Trainer.finish

    def signalled_while_finishing(self):
        self.stop_signal = signum
        return finish(self)

    monkeypatch.setattr(T, "_run_stacked", broken)
    monkeypatch.setattr(T.Trainer, "finish", signalled_while_finishing)
    spec_path = _write_spec(tmp_path, "presets: [TINY]\nseeds: [1, 2]\n")
    argv = ["sweep", str(spec_path), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    assert main([*argv, "--stack-seeds"]) == 128 + signum
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    assert [(Path(t.dir) / "summary.json").exists() for t in spec.trials] == [True, False]
    status = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [t["status"] for t in status["trials"]] == ["done", "interrupted"]
    assert signal.Signals(signum).name in status["trials"][1]["error"]


def test_a_folder_holding_another_sweep_is_refused(tmp_path):
    """Its record (sweep.json) would be replaced and its runs reported under the new name."""
    path = _write_spec(tmp_path, "name: second\npresets: [TINY]\nseeds: 1\n")
    spec = S.load_spec(str(path), tmp_path / "sw")
    (tmp_path / "sw").mkdir()
    record = json.dumps({"name": "first", "trials": []})
    (tmp_path / "sw" / "sweep.json").write_text(record)
    with pytest.raises(S.SweepError, match="holds the sweep 'first'; give this sweep"):
        S.run_sweep(spec, backend="serial")
    assert (tmp_path / "sw" / "sweep.json").read_text() == record  # untouched
    assert not list((tmp_path / "sw").glob("tiny"))  # nothing trained


def test_a_sweeps_shared_overrides_may_go_unread_by_some_trials(tmp_path):
    """Overrides shared by the presets of a sweep (QMIX's n-step length beside a grid of
    target kinds) are read by some trials only: the sweep takes them, where a single command
    would refuse the unread key."""
    body = (
        "presets: [smac/3m_qmix]\nseeds: [1]\noverrides: {algo.n_step: 5}\n"
        "grid: {algo.targets: [one_step, n_step]}\n"
    )
    spec = S.load_spec(str(_write_spec(tmp_path, body)), tmp_path / "sw")
    assert len(spec.trials) == 2
    with pytest.raises(C.ConfigError, match="'algo.n_step' is read with algo.targets=n_step"):
        C.load("smac/3m_qmix", ["algo.n_step=5"])


def test_a_setting_no_trial_reads_is_refused(tmp_path):
    # Two trials that differ in name only would read as "n_step makes no difference".
    body = "presets: [smac/3m_qmix]\nseeds: [1]\ngrid: {algo.n_step: [3, 7]}\n"
    with pytest.raises(S.SweepError, match="no trial reads 'algo.n_step': config field"):
        S.load_spec(str(_write_spec(tmp_path, body)), tmp_path / "sw")


def test_a_spec_s_preset_files_are_read_beside_it(tmp_path, monkeypatch):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "exp.yaml").write_text(
        "base: mpe/simple_spread_fast\nalgo:\n  clip: 0.1\n"
    )
    spec_path = tmp_path / "proj" / "spec.yaml"
    spec_path.write_text("presets: [exp.yaml]\nseeds: [1]\n")
    monkeypatch.chdir(tmp_path)  # not the spec's folder
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    assert spec.trials[0].preset == str((tmp_path / "proj" / "exp.yaml").resolve())


def test_a_sweep_of_two_tasks_plots_each_task_s_default_metric(tmp_path, monkeypatch):
    """A spec of a StarCraft-style preset and a particle world without ``metric:``: its
    curves.png has a win-rate panel and a return panel (one metric for all left one out), as
    its report.md gives each configuration its own."""
    from mappo.experiments import plot

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text("presets: [mpe/simple_spread_fast, smac/3m_fast]\nseeds: [1]\n")
    spec = S.load_spec(str(spec_path), tmp_path / "sw")
    metrics = ("eval/eval_return_mean", "eval/eval_battle_won")
    for trial, metric in zip(spec.trials, metrics, strict=True):
        d = Path(trial.dir)
        d.mkdir(parents=True)
        cfg = C.load(trial.preset, {**trial.overrides, "total_env_steps": 2000})
        (d / "config.yaml").write_text(yaml.safe_dump(C.to_dict(cfg), sort_keys=False))
        (d / "metrics.csv").write_text(f"env_steps,iteration,{metric}\n1000,1,0.1\n2000,2,0.2\n")
        (d / "summary.json").write_text(json.dumps({"env_steps": 2000}))
    figures = []
    draw = plot.plot_curves

    def keep(*args, **kwargs):  # (write_outputs closes the figure it draws)
        figures.append(draw(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(plot, "plot_curves", keep)
    report = S.write_outputs(spec)
    assert report is not None and "| smac/3m_fast mappo | eval/eval_battle_won | 1 |" in report
    (fig,) = figures
    assert [(ax.get_title(), ax.get_ylabel()) for ax in fig.axes] == [
        ("mpe/simple_spread", "eval/eval_return_mean"),
        ("smac/3m", "eval/eval_battle_won"),
    ]
    assert (tmp_path / "sw" / "curves.png").is_file()


def test_a_run_dir_in_a_spec_is_refused(tmp_path):
    """Each trial's folder is the sweep's: a run_dir would be written into the trials' configs
    without being where they trained."""
    body = "presets: [TINY]\nseeds: [1]\noverrides: {run_dir: elsewhere}\n"
    with pytest.raises(S.SweepError, match="sets 'run_dir', which the sweep sets for each trial"):
        S.load_spec(str(_write_spec(tmp_path, body)), tmp_path / "sw")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_sweep_on_cuda_without_a_gpu_is_refused_before_any_trial(tmp_path, capsys):
    body = "presets: [TINY]\nseeds: [1, 2]\noverrides: {device: cuda}\n"
    sweep_dir = tmp_path / "sw"
    argv = ["sweep", str(_write_spec(tmp_path, body)), "--dir", str(sweep_dir), "--backend"]
    assert main([*argv, "serial"]) == 2
    err = capsys.readouterr().err
    assert "trains on device=cuda, but no CUDA device is available here" in err
    assert not any(sweep_dir.rglob("config.yaml"))  # no trial folder was written


def test_a_sweep_too_large_to_hold_is_refused_before_its_trials_are_made(tmp_path):
    """A seed count or grid typo (10**9 seeds, 10**6 grid points) exhausted the memory, or ran
    for minutes, before: one line with the counts instead, at once."""
    spec = _write_spec(tmp_path, "presets: [TINY]\nseeds: 1000000000\n")
    with pytest.raises(S.SweepError, match="asks for 1,000,000,000 seeds; a sweep holds at most"):
        S.load_spec(str(spec), tmp_path / "sw")
    grid = "{" + ", ".join(f"k{i}: [{', '.join(map(str, range(10)))}]" for i in range(6)) + "}"
    spec = _write_spec(tmp_path, f"presets: [TINY]\nseeds: 2\ngrid: {grid}\n")
    with pytest.raises(S.SweepError, match=r"2,000,000 trials \(1 presets x 1,000,000 grid"):
        S.load_spec(str(spec), tmp_path / "sw")
