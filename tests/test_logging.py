"""Where a run's numbers go: TensorBoard on resume, Weights & Biases (a stand-in module that
records its calls: wandb itself is an optional extra), summary.json."""

from __future__ import annotations

import importlib.machinery
import json
import shutil
import sys
import types
from pathlib import Path

import pytest

import mappo
from mappo import config as C
from mappo.logging import MetricsError
from mappo.trainer import _drop_stale_summary, resume, resume_seeds, train, train_seeds

TINY = {
    "env.num_envs": 4,
    "rollout_length": 25,
    "total_env_steps": 4 * 25 * 4,
    "algo.epochs": 1,
    "eval_episodes": 2,
    "eval_interval": 2,
    "log_interval": 1,
    "checkpoint_interval": 1,
    "progress": False,
    "threads": 1,
}


class _FakeRun:
    def __init__(self, calls: list, kwargs: dict) -> None:
        self.calls, self.id = calls, kwargs["id"]

    def log(self, row: dict, step: int) -> None:
        self.calls.append(("log", self.id, step))

    def finish(self, exit_code: int = 0) -> None:
        self.calls.append(("finish", self.id, exit_code))


@pytest.fixture
def fake_wandb(monkeypatch):
    """A ``wandb`` module that records ``init``, ``log`` and ``finish``; ``fail`` makes init
    raise as wandb does without a login."""
    calls: list = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.fail = False

    def init(**kwargs):  # noqa: ANN003, ANN202
        if module.fail:
            raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login()")
        calls.append(("init", kwargs))
        return _FakeRun(calls, kwargs)

    module.init = init
    module.calls = calls
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def _inits(calls: list) -> list[dict]:
    return [kwargs for kind, kwargs, *_ in calls if kind == "init"]


def test_a_wandb_run_keeps_its_id_on_resume_and_seeds_log_apart(tmp_path, fake_wandb):
    run = train("mpe/simple_spread_fast", {**TINY, "run_dir": str(tmp_path), "wandb": True})
    (first,) = _inits(fake_wandb.calls)
    assert first["resume"] == "allow" and first["reinit"] == "create_new"
    assert first["group"].startswith("mpe/simple_spread_fast rmappo ")
    assert first["name"] == run.dir.name
    assert json.loads((run.dir / "wandb_id").read_text())["id"] == first["id"]
    assert fake_wandb.calls[-1] == ("finish", first["id"], 0)
    copy = tmp_path / "copy"
    shutil.copytree(run.dir, copy)  # a copy to fork from: a W&B run of its own
    resume(run.dir, {"total_env_steps": 4 * 25 * 6})
    assert _inits(fake_wandb.calls)[-1]["id"] == first["id"]  # the same W&B run continues
    with pytest.warns(UserWarning, match="continues in a new Weights & Biases run: its wandb_id"):
        resume(copy, {"total_env_steps": 4 * 25 * 6})
    assert _inits(fake_wandb.calls)[-1]["id"] != first["id"]
    # a fresh run in a folder that holds another run's id starts a W&B run of its own
    caller = tmp_path / "mine"
    caller.mkdir()
    (caller / "wandb_id").write_text((run.dir / "wandb_id").read_text())
    train("mpe/simple_spread_fast", {**TINY, "wandb": True}, run_dir=caller)
    assert _inits(fake_wandb.calls)[-1]["id"] != first["id"]
    # another setting is another group; a run that fails is marked so
    fake_wandb.calls.clear()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mappo.trainer.Trainer.after_iteration", _fails)
        with pytest.raises(RuntimeError, match="an update that fails"):
            other_cfg = {**TINY, "run_dir": str(tmp_path / "c"), "wandb": True, "algo.clip": 0.1}
            train("mpe/simple_spread_fast", other_cfg)
    (other,) = _inits(fake_wandb.calls)
    assert other["group"].startswith("mpe/simple_spread_fast rmappo ")
    assert other["group"] != first["group"]
    assert fake_wandb.calls[-1] == ("finish", other["id"], 1)
    # Stacked seeds: one W&B run each, each logging its own steps.
    fake_wandb.calls.clear()
    stacked = train_seeds(
        "mpe/simple_spread_fast",
        {**TINY, "run_dir": str(tmp_path / "s"), "wandb": True, "num_seeds": 2},
    )
    ids = [kwargs["id"] for kwargs in _inits(fake_wandb.calls)]
    assert len(set(ids)) == 2
    for k, path in enumerate(r.dir for r in stacked):
        assert json.loads((path / "wandb_id").read_text())["id"] == ids[k]
        logged = [c for c in fake_wandb.calls if c[0] == "log" and c[1] == ids[k]]
        assert [c[2] for c in logged] == [100, 200, 300, 400]


def test_an_old_wandb_is_named_before_the_run_starts(tmp_path, fake_wandb, monkeypatch) -> None:
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.16.6")
    with pytest.raises(C.ConfigError, match="wandb 0.16.6 is older than 0.19.10, which the runs"):
        train("mpe/simple_spread_fast", {**TINY, "run_dir": str(tmp_path), "wandb": True})
    assert not any(tmp_path.iterdir())


def test_a_wandb_run_opens_without_wandb_and_resumes_with_wandb_false(tmp_path, fake_wandb):
    run = train("mpe/simple_spread_fast", {**TINY, "run_dir": str(tmp_path), "wandb": True})
    sys.modules.pop("wandb")  # a laptop without wandb reads the run
    mappo.load_policy(run.dir)
    from mappo.experiments.runs import read_run

    assert read_run(run.dir).algo == "rmappo"
    with pytest.raises(C.ConfigError, match="Weights & Biases is not installed"):
        resume(run.dir, {"total_env_steps": 4 * 25 * 6})
    resume(run.dir, {"total_env_steps": 4 * 25 * 6, "wandb": False})


def test_wandb_that_cannot_start_is_one_line_and_leaves_no_folder(tmp_path, fake_wandb) -> None:
    fake_wandb.fail = True
    with pytest.raises(MetricsError, match="Weights & Biases could not start a run "):
        train("mpe/simple_spread_fast", {**TINY, "run_dir": str(tmp_path), "wandb": True})
    assert not any(tmp_path.iterdir())
    # a resume that cannot start W&B leaves the run's files as they were
    fake_wandb.fail = False
    run = train("mpe/simple_spread_fast", {**TINY, "run_dir": str(tmp_path), "wandb": True})
    for path in sorted((run.dir / "checkpoints").glob("*.pt"))[-2:]:
        path.unlink()  # (a resume from an older checkpoint would cut metrics.csv)
    before = {p: p.read_bytes() for p in run.dir.rglob("*") if p.is_file()}
    fake_wandb.fail = True
    with pytest.raises(MetricsError, match="could not start a run \\(RuntimeError: api_key not"):
        resume(run.dir, {"total_env_steps": 4 * 25 * 6})
    assert {p: p.read_bytes() for p in run.dir.rglob("*") if p.is_file()} == before
    # a caller's folder holding an old run's wandb_id is tidied like any other when a fresh
    # run without W&B stops before training (it kept its config.yaml, and refused the next)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "wandb_id").write_text("{}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mappo.trainer.Trainer.after_iteration", _fails)
        with pytest.raises(RuntimeError):
            train("mpe/simple_spread_fast", TINY, run_dir=mine)
    assert sorted(p.name for p in mine.iterdir()) == ["wandb_id"]


def _fails(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError("an update that fails")


def test_tensorboard_keeps_the_step_a_resume_starts_from(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train("mpe/simple_spread_fast", {**TINY, "run_dir": str(tmp_path)})
    older = tmp_path / "older"
    shutil.copytree(run.dir, older)
    for path in sorted((older / "checkpoints").glob("*.pt"))[-2:]:
        path.unlink()  # resume from the second checkpoint: steps 300 and 400 are done again
    resume(older, {"total_env_steps": 4 * 25 * 4})
    board = EventAccumulator(str(older / "tensorboard"))
    board.Reload()
    steps = [e.step for e in board.Scalars("iteration")]
    assert steps == [100, 200, 300, 400]


def test_a_summary_of_an_abandoned_future_is_removed(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"env_steps": 800}))
    _drop_stale_summary(tmp_path, 800)  # a finished run extended: its summary still holds
    assert path.exists()
    _drop_stale_summary(tmp_path, 400)
    assert not path.exists()
    _drop_stale_summary(Path(tmp_path / "none"), 400)  # no summary: nothing to do


def test_resume_seeds_keeps_wandb_ids(tmp_path, fake_wandb):
    runs = train_seeds(
        "mpe/simple_spread_fast",
        {**TINY, "run_dir": str(tmp_path), "wandb": True, "num_seeds": 2},
    )
    ids = [kwargs["id"] for kwargs in _inits(fake_wandb.calls)]
    fake_wandb.calls.clear()
    resume_seeds([r.dir for r in runs], {"total_env_steps": 4 * 25 * 6})
    assert [kwargs["id"] for kwargs in _inits(fake_wandb.calls)] == ids


def test_a_metrics_file_held_open_elsewhere_gets_its_rows_when_it_can(tmp_path, monkeypatch):
    # Windows refuses to write a file that another program (a spreadsheet) holds open: the run
    # stopped at the first row; now the rows wait beside it and are written when it can be.
    import csv

    from mappo.logging import PENDING_FILE, MetricsLogger

    logger = MetricsLogger(tmp_path, tensorboard=False, wandb_project=None, config={})
    logger.log(10, {"loss/x": 1.0})
    held = {"on": True}
    real_open, real_replace = Path.open, Path.replace
    csv_path, pending = tmp_path / "metrics.csv", tmp_path / PENDING_FILE

    def refusing_open(self, mode="r", *args, **kwargs):
        if held["on"] and self == csv_path and "a" in mode:
            raise PermissionError(13, "The process cannot access the file")
        return real_open(self, mode, *args, **kwargs)

    def refusing_replace(self, target):
        if held["on"] and Path(target) == csv_path:
            raise PermissionError(13, "The process cannot access the file")
        return real_replace(self, target)

    monkeypatch.setattr(Path, "open", refusing_open)
    monkeypatch.setattr(Path, "replace", refusing_replace)

    def steps(path):
        with real_open(path, newline="", encoding="utf-8") as f:
            return [int(r["env_steps"]) for r in csv.DictReader(f)]

    with pytest.warns(RuntimeWarning, match="another program may hold it open") as said:
        logger.log(20, {"loss/x": 2.0})
        logger.log(30, {"loss/x": 3.0, "loss/y": 0.5})  # (a new column: a rewrite)
    assert len(said) == 1 and steps(csv_path) == [10] and steps(pending) == [10, 20, 30]
    held["on"] = False
    logger.log(40, {"loss/x": 4.0})
    assert steps(csv_path) == [10, 20, 30, 40] and not pending.exists()
    # Still held when the run ends (or killed while held): a resume reads the held rows.
    held["on"] = True
    with pytest.warns(RuntimeWarning, match="cannot be written now"):
        logger.log(50, {"loss/x": 5.0, "loss/y": 0.1})
        logger.log(60, {"loss/x": 6.0, "loss/y": 0.2})
    with pytest.warns(RuntimeWarning, match="complete rows are in .*metrics.pending.csv"):
        logger.close()
    assert steps(csv_path) == [10, 20, 30, 40] and steps(pending) == [10, 20, 30, 40, 50, 60]
    with pytest.warns(RuntimeWarning, match="cannot be written now"):  # still held on resume
        resumed = MetricsLogger(tmp_path, False, None, {}, resume_step=50)
    assert steps(pending) == [10, 20, 30, 40, 50]
    held["on"] = False
    resumed.log(60, {"loss/x": 6.5})
    assert steps(csv_path) == [10, 20, 30, 40, 50, 60] and not pending.exists()
    resumed.close()


def test_a_pending_file_held_open_too_does_not_stop_training(tmp_path, monkeypatch):
    # The warning names metrics.pending.csv, so a user may open it as well: neither writing it
    # nor removing it may stop the run, and a stale one left behind must not win a resume.
    import csv

    from mappo.logging import PENDING_FILE, MetricsLogger

    csv_path, pending = tmp_path / "metrics.csv", tmp_path / PENDING_FILE
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb_project=None, config={})
    logger.log(10, {"loss/x": 1.0})
    pending.write_text("env_steps,loss/x\n10,1.0\n", encoding="utf-8")  # an earlier hold's
    locked = {csv_path, pending}
    real_open, real_replace, real_unlink = Path.open, Path.replace, Path.unlink

    def refusing_open(self, mode="r", *args, **kwargs):
        if self in locked and "a" in mode:
            raise PermissionError(13, "locked")
        return real_open(self, mode, *args, **kwargs)

    def refusing_replace(self, target):
        if Path(target) in locked:
            raise PermissionError(13, "locked")
        return real_replace(self, target)

    def refusing_unlink(self, missing_ok=False):
        if self in locked:
            raise PermissionError(13, "locked")
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "open", refusing_open)
    monkeypatch.setattr(Path, "replace", refusing_replace)
    monkeypatch.setattr(Path, "unlink", refusing_unlink)
    with pytest.warns(RuntimeWarning, match="cannot be written now"):
        logger.log(20, {"loss/x": 2.0})
    locked.discard(csv_path)  # metrics.csv free again, the pending file still open
    logger.log(30, {"loss/x": 3.0})
    logger.close()
    monkeypatch.undo()

    def steps(path):
        with path.open(newline="", encoding="utf-8") as f:
            return [int(r["env_steps"]) for r in csv.DictReader(f)]

    assert steps(csv_path) == [10, 20, 30] and steps(pending) == [10]  # (the stale one stayed)
    MetricsLogger(tmp_path, False, None, {}, resume_step=30).close()
    assert steps(csv_path) == [10, 20, 30]  # the resume took the file that goes further


def test_a_metrics_file_saved_by_a_spreadsheet_still_resumes(tmp_path):
    """A spreadsheet's "CSV UTF-8" starts the file with a byte-order mark: its rows are read
    as the run's (it was refused as having no env_steps column)."""
    from mappo.experiments.runs import read_run
    from mappo.logging import MetricsLogger

    (tmp_path / "metrics.csv").write_text(
        "\ufeffenv_steps,train/episode_return\n10,1.5\n20,2.5\n30,3.5\n", encoding="utf-8"
    )
    (tmp_path / "config.yaml").write_text("seed: 1\n", encoding="utf-8")
    assert list(read_run(tmp_path).columns["env_steps"]) == [10, 20, 30]
    MetricsLogger(tmp_path, False, None, {}, resume_step=20).close()
    kept = (tmp_path / "metrics.csv").read_text(encoding="utf-8-sig").splitlines()
    assert kept == ["env_steps,train/episode_return", "10,1.5", "20,2.5"]
