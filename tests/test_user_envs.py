"""Environments of the user's own on the command line: ``python:<module>:<class>`` names and
``--import MODULE``, so that a run of such an env trains, evaluates, renders and resumes from
``mappo`` like a built-in one; and the errors of a name that cannot be built."""

from __future__ import annotations

import csv
import functools
import json
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from mappo.cli import main
from mappo.envs import ActionError, EnvError, EnvStep, make, registry

DOCS = Path(__file__).parent.parent / "docs" / "environments.md"
TINY = ["env.num_envs=4", "total_env_steps=300", "eval_episodes=2", "progress=false"]
TINY += ["algo.epochs=1", "env.kwargs={num_agents: 3}"]


def _example_module(folder: Path, env_name: str) -> str:
    """Write the docs' GuessTheColor example as a module of a fresh name into ``folder``, with
    the env registered as ``env_name``; returns the module's name."""
    block = next(
        b
        for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
        if "class GuessTheColor" in b
    )
    module = f"user_envs_{uuid.uuid4().hex[:8]}"
    (folder / f"{module}.py").write_text(block.replace("example/guess_the_color", env_name))
    return module


@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding the user's module, as the current directory (not on ``sys.path``: the
    ``mappo`` command searches it itself), with ``sys.path`` restored afterwards."""
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    return folder


def _one_run(root: Path) -> Path:
    (checkpoints,) = list(root.glob("**/checkpoints"))
    return checkpoints.parent


def test_a_python_path_name_trains_evaluates_and_resumes(user_folder, tmp_path, capsys) -> None:
    module = _example_module(user_folder, f"unused/{uuid.uuid4().hex[:6]}")
    name = f"python:{module}:GuessTheColor"
    root = tmp_path / "runs"
    assert (
        main(["train", "mpe/simple_spread_fast", f"env.name={name}", *TINY, f"run_dir={root}"]) == 0
    )
    run = _one_run(root)
    assert run.relative_to(root).parts[:3] == ("python", module, "GuessTheColor")
    # A later process knows nothing of the module (this one trusts it since it trained on
    # it): the saved name rebuilds the env, once the user says the module may be imported
    # (opening a saved run imports nothing on its own).
    from mappo.envs import registry

    sys.modules.pop(module)
    assert module in registry._TRUSTED
    registry._TRUSTED.discard(module)
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "3"]) == 2
    assert capsys.readouterr().err == (
        f"mappo: error: '{run}' names its env by import path ({name}); opening a saved run "
        f"imports no module named in it on its own: if you trust the code of '{module}', pass "
        f"--import {module} (from Python: mappo.envs.trust_module('{module}'))\n"
    )
    assert module not in sys.modules
    assert main(["eval", str(run), "--episodes", "3", "--json", "--import", module]) == 0
    result = capsys.readouterr().out
    assert '"eval_hits"' in result and '"eval_episodes": 3,' in result
    resume = ["train", "--resume", str(run), "total_env_steps=500", "progress=false"]
    assert main([*resume, "--import", module]) == 0
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*.pt"))[-1] > "iter_00000003"
    capsys.readouterr()
    assert main(["bench", "env", "--envs", name, "--num-envs", "2", "--seconds", "0.01"]) == 0
    assert name in capsys.readouterr().out
    # The docs' example draws nothing: render says so in one line and writes no file.
    # the command that a Ctrl-C prints to continue the run names the module to trust
    from mappo.cli import _import_option

    assert _import_option(run) == f" --import {module}"
    assert main(["render", name, "--gif", str(tmp_path / "a.gif")]) == 2
    err = capsys.readouterr().err
    assert "cannot render frames (GuessTheColor does not implement render())" in err
    assert not (tmp_path / "a.gif").exists()


def test_a_python_path_env_of_many_copies_is_probed_as_itself(user_folder, tmp_path) -> None:
    # Above 4,096 copies the memory check builds one copy to measure; it took a python: env
    # for an adapter's and passed it num_workers=0, which the class refused. A sweep's metric
    # check builds one copy the same way, and let any metric through for such an env.
    from mappo.envs.registry import uses_workers
    from mappo.experiments.spec import SweepError, load_spec

    module = _example_module(user_folder, f"unused/{uuid.uuid4().hex[:6]}")
    name = f"python:{module}:GuessTheColor"
    assert not uses_workers(name) and uses_workers("pettingzoo:mpe2.simple_spread_v3")
    over = [f"env.name={name}", "env.num_envs=4100", "rollout_length=2", "total_env_steps=8200"]
    root = tmp_path / "runs"
    argv = ["train", "mpe/simple_spread_fast", *over, "eval_episodes=2", "progress=false"]
    assert main([*argv, "threads=1", f"run_dir={root}"]) == 0
    spec = user_folder / "spec.yaml"
    spec.write_text(
        f"presets: [mpe/simple_spread_fast]\noverrides: {{env.name: '{name}'}}\n"
        "metric: eval/eval_hts\n",
        encoding="utf-8",
    )
    with pytest.raises(SweepError, match="did you mean 'eval/eval_hits'"):
        load_spec(str(spec), tmp_path / "sw")


def test_import_loads_the_module_that_registers_an_env(user_folder, tmp_path, capsys) -> None:
    env_name = f"mine/guess_{uuid.uuid4().hex[:6]}"
    module = _example_module(user_folder, env_name)
    root = tmp_path / "runs"
    argv = ["train", "mpe/simple_spread_fast", f"env.name={env_name}", *TINY, f"run_dir={root}"]
    assert main([*argv, "--import", module]) == 0
    run = _one_run(root)

    # As in a new process: the name is unknown until the module is imported again.
    registry._ENVS.pop(env_name)
    sys.modules.pop(module)
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"unknown environment '{env_name}'" in err
    assert "python:<module>:<class>" in err and "--import <module> (mappo train, eval" in err

    assert main(["eval", str(run), "--episodes", "2", "--import", module]) == 0
    assert "eval_hits" in capsys.readouterr().out
    assert main(["list", "--import", module]) == 0
    assert env_name in capsys.readouterr().out
    bench = ["bench", "env", "--envs", env_name, "--num-envs", "2", "--seconds", "0.01"]
    assert main([*bench, "--no-pettingzoo", "--import", module]) == 0
    assert env_name in capsys.readouterr().out


BAD_NAMES = [
    ("python:user_mod", "'python:user_mod' names no class: write python:<module>:<class>"),
    ("python::Thing", "names no class"),
    ("python:no_such_module_xyz:Env", "module 'no_such_module_xyz' is not importable; is its"),
    ("python:bad-name:Env", "'bad-name' is not a module name"),
    ("python:user_mod.py:Env", "'user_mod.py' is a file name; give the module's name, without"),
    ("python:user_mod:Nope", "python:user_mod:Nope: 'user_mod' has no attribute 'Nope'"),
    ("python:user_mod:Env.nope", "'user_mod.Env' has no attribute 'nope'"),
    ("python:user_mod:VALUE", "'user_mod.VALUE' is an int, not a subclass of mappo.envs.Batc"),
    ("python:user_mod:Env", "'user_mod.Env' is the class Env, not a subclass of mappo.envs."),
    ("python:user_mod:make_env", "'user_mod.make_env' is a function, not a subclass of"),
    ("python:user_mod:Parallel", "for a PettingZoo ParallelEnv use pettingzoo:user_mod:Parallel"),
    ("python:user_mod:Strict", "bad parameter for environment 'python:user_mod:Strict': "),
    (
        "python:user_mod:Refuses",
        "python:user_mod:Refuses: user_mod.Refuses(...) raised ValueError: ",
    ),
    ("python:user_raises:Env", "importing module 'user_raises' raised RuntimeError: broken"),
    # a library function that a config could name is never called, whatever its arguments
    ("python:torch.hub:load", "'torch.hub.load' is a function, not a subclass of mappo.envs"),
]


@pytest.mark.parametrize(("name", "message"), BAD_NAMES)
def test_python_names_that_cannot_be_built_are_one_line(user_folder, name, message) -> None:
    (user_folder / "user_mod.py").write_text(
        "from mappo.envs import BatchedEnv\n"
        "from toy_env import MatchEnv\n"
        "VALUE = 3\n"
        "class Env:\n    pass\n"
        "def make_env(**kwargs):\n    return None\n"
        "class Parallel:\n    possible_agents = ['a']\n"
        "class Strict(BatchedEnv):\n"
        "    def __init__(self, num_envs, device='cpu', seed=0, size=3):\n        pass\n"
        "class Refuses(MatchEnv):\n"
        "    def __init__(self, num_envs, device='cpu', seed=0):\n"
        "        raise ValueError('num_envs must be even\\nsecond line')\n"
    )
    (user_folder / "user_raises.py").write_text("raise RuntimeError('broken\\nsecond line')\n")
    for module in ("user_mod", "user_raises"):
        sys.modules.pop(module, None)
    kwargs = {"colour": 1} if name.endswith("Strict") else {}
    with pytest.raises(EnvError) as info:
        make(name, num_envs=2, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_saved_run_never_calls_what_its_config_names(tmp_path, capsys, monkeypatch) -> None:
    """A shared checkpoint whose config was edited to name a library function (here one that
    would fetch and run code), or a module whose import runs code (one beside it, in a folder
    on the path), is refused before anything is imported or called, for every scheme that
    imports what a name points to."""
    root = tmp_path / "runs"
    assert main(["train", "mpe/simple_spread", *TINY[:-1], f"run_dir={root}"]) == 0
    run = _one_run(root)
    checkpoint = sorted((run / "checkpoints").glob("iter_*.pt"))[-1]
    data = torch.load(checkpoint, weights_only=True)
    marker = tmp_path / "ran"
    module = f"brought_along_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (
        "pettingzoo:torch.hub:load",
        "python:os:system",
        f"pettingzoo:{module}",
        f"gymnasium:{module}:Brought-v0",
        "pettingzoo:gymnasium:make",  # (a known package's function, which imports an id's module)
    ):
        data["config"]["env"]["name"] = name
        data["config"]["env"]["kwargs"] = {
            "command": f"touch {marker}",
            "repo_or_dir": "x/y",
            "id": f"{module}:Brought-v0",
        }
        shared = tmp_path / "shared.pt"
        torch.save(data, shared)
        capsys.readouterr()
        assert main(["eval", str(shared), "--episodes", "2"]) == 2
        err = capsys.readouterr().err
        assert f"names its env by import path ({name}); opening a saved run imports" in err
        assert not marker.exists() and module not in sys.modules


def test_a_class_of_the_running_script_is_named_as_such(
    user_folder, tmp_path, capsys, monkeypatch
) -> None:
    """``python:__main__:<class>`` trains (with a warning), but only a script that defines the
    class can open the run: the mappo command says so instead of a missing attribute."""
    import mappo

    module = _example_module(user_folder, f"unused/{uuid.uuid4().hex[:6]}")
    monkeypatch.syspath_prepend(str(user_folder))
    env_class = __import__(module).GuessTheColor
    monkeypatch.setattr(sys.modules["__main__"], "LocalColors", env_class, raising=False)
    overrides = [a for a in TINY if not a.startswith("env.kwargs")]
    overrides += ["env.name=python:__main__:LocalColors", "env.kwargs={num_agents: 3}"]
    with pytest.warns(UserWarning, match="is a class of the running script"):
        run = mappo.train("mpe/simple_spread_fast", overrides, run_dir=tmp_path / "runs")
    # the process that trained it trusts its script; the mappo command is another process
    assert "__main__" in registry._TRUSTED
    registry._TRUSTED.discard("__main__")
    capsys.readouterr()
    assert main(["eval", str(run.dir), "--episodes", "2"]) == 2
    assert "names its env in the script that trained it" in capsys.readouterr().err
    assert main(["eval", str(run.dir), "--import", "__main__"]) == 2
    assert "--import __main__ cannot reach the script" in capsys.readouterr().err
    # The script that defines the class opens it, as the message says.
    monkeypatch.setattr(registry, "_TRUSTED", set(registry._TRUSTED))
    registry.trust_module("__main__")
    assert mappo.resume(run.dir, {"total_env_steps": 500}).summary["env_steps"] >= 500


def test_a_bad_import_option_is_one_line_and_exit_2(user_folder, capsys) -> None:
    assert main(["list", "--import", "no_such_module_xyz"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "mappo: error: --import no_such_module_xyz: module 'no_such_module_xyz' is not "
        "importable; is its folder on PYTHONPATH (or the current directory), or is it "
        "installed?\n"
    )


def test_a_folder_of_runs_names_one_of_them(tmp_path, capsys) -> None:
    # A user who gives the run_dir= root (or runs/) instead of one run gets a run to give.
    old = tmp_path / "runs" / "python" / "m" / "Env" / "rmappo" / "20260101-000000_seed1"
    new = tmp_path / "runs" / "mpe" / "simple_spread" / "rmappo" / "20260102-000000_seed1"
    for run in (old, new):
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "iter_00000001.pt").write_bytes(b"")
    (tmp_path / "runs" / "empty" / "checkpoints").mkdir(parents=True)
    assert main(["eval", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path / 'runs'}' is not a run directory but holds 2 runs below it" in err
    assert str(new) in err or str(old) in err
    assert main(["eval", str(tmp_path)]) == 2  # from above runs/, through a three-part task
    assert "holds 2 runs below it" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "runs" / "python")]) == 2
    err = capsys.readouterr().err
    assert f"holds a run below it; give one run directory, e.g. '{old}'" in err
    assert main(["train", "--resume", str(tmp_path / "runs" / "empty")]) == 2
    assert "runs/empty' a mappo run directory?" in capsys.readouterr().err


def test_a_sweep_resumes_trials_of_a_python_env(user_folder, tmp_path, capsys) -> None:
    # The spec names the env, so its trials resume without --import (a saved run alone would
    # not be trusted to name a module).
    module = _example_module(user_folder, f"unused/{uuid.uuid4().hex[:6]}")
    spec = user_folder / "spec.yaml"
    body = (
        "presets: [mpe/simple_spread_fast]\nseeds: 1\n"
        f"overrides: {{env.name: 'python:{module}:GuessTheColor', env.num_envs: 4, "
        "env.kwargs: {num_agents: 3}, eval_episodes: 2, algo.epochs: 1, total_env_steps: STEPS}\n"
    )
    argv = ["sweep", str(spec), "--dir", str(tmp_path / "sw"), "--backend", "serial"]
    for steps in (200, 400):
        spec.write_text(body.replace("STEPS", str(steps)))
        assert main(argv) == 0, capsys.readouterr().err
    run = tmp_path / "sw" / "mpe" / "simple_spread_fast" / "default" / "seed1"
    assert json.loads((run / "summary.json").read_text())["env_steps"] == 400


def test_dead_agents_masks_may_allow_nothing() -> None:
    """The output checks allow a dead agent a mask with no action (its action is ignored), so
    the env's own action validation must not refuse whatever action it is given either (the
    evaluation of such an env failed at its first step)."""
    from toy_env import MatchEnv

    class DeadAllowNothing(MatchEnv):
        def _observe(self, *args: Any, **kwargs: Any) -> EnvStep:
            step = super()._observe(*args, **kwargs)
            step.action_mask["agents"][~step.alive["agents"]] = False
            return step

    env = DeadAllowNothing(num_envs=3, masks=True, deaths=True, num_agents=2)
    step = env.reset(seed=0)
    for _ in range(4):
        actions = step.action_mask["agents"][..., :3].int().argmax(-1, keepdim=True)
        step = env.step({"agents": actions})
    assert not step.alive["agents"][:, 1].any() and not step.action_mask["agents"][:, 1].any()
    step = env.step({"agents": torch.zeros(3, 2, 1, dtype=torch.long)})  # the dead agent's 0
    # an alive agent's forbidden action is still refused
    with pytest.raises(ActionError, match="is not allowed by its action mask"):
        env.step({"agents": torch.full((3, 2, 1), 3, dtype=torch.long)})


def test_an_env_changed_since_training_is_named(user_folder, tmp_path, capsys) -> None:
    # The user edits the env after training (5 colours instead of 4): evaluating or resuming
    # the run names the difference instead of a shape error inside the networks.
    module = _example_module(user_folder, f"unused/{uuid.uuid4().hex[:6]}")
    root = tmp_path / "runs"
    name = f"python:{module}:GuessTheColor"
    assert (
        main(["train", "mpe/simple_spread_fast", f"env.name={name}", *TINY, f"run_dir={root}"]) == 0
    )
    run = _one_run(root)
    source = user_folder / f"{module}.py"
    source.write_text(source.read_text().replace("num_colors: int = 4", "num_colors: int = 5"))
    sys.modules.pop(module)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    capsys.readouterr()
    for argv, what in (
        (["eval", str(run), "--episodes", "2"], "evaluate"),
        (["train", "--resume", str(run), "total_env_steps=600"], "resume"),
    ):
        assert main([*argv, "--import", module]) == 2
        err = capsys.readouterr().err
        assert "is not the one" in err and "was trained on (group 'players': observation " in err
        assert f"shape (5,) now, (4,) when trained); {what} with the env's code" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_spec_differences_in_words() -> None:
    from mappo.data import ActionSpec, EnvSpec, GroupSpec, spec_difference, spec_to_dict

    def spec(n: int = 2, obs: int = 4, heads: tuple = (5,), state: int = 8, mask: bool = False):
        group = GroupSpec(tuple(f"a{i}" for i in range(n)), (obs,), ActionSpec(heads), mask)
        return EnvSpec({"agents": group}, (state,), 25)

    saved = spec_to_dict(spec())
    assert spec_difference(saved, spec()) is None
    assert spec_difference(saved, EnvSpec(spec().groups, (8,), 99)) is None  # limits may change
    assert spec_difference(saved, spec(n=3)) == "group 'agents' has 3 agents now, 2 when trained"
    assert spec_difference(saved, spec(heads=(5, 2))) == (
        "group 'agents': discrete action heads (5, 2) now, (5,) when trained"
    )
    assert spec_difference(saved, spec(mask=True)) == (
        "group 'agents': action masks True now, False when trained"
    )
    assert spec_difference(saved, spec(state=9)) == (
        "the global state has shape (9,) now, (8,) when trained"
    )
    # Another kind of actions is named as such (it read "heads () now, (5,) when trained").
    box = GroupSpec(("a0", "a1"), (4,), ActionSpec.box((-1.0, -1.0), (1.0, 1.0)), False)
    assert spec_difference(saved, EnvSpec({"agents": box}, (8,), 25)) == (
        "group 'agents': continuous actions now, discrete actions when trained"
    )
    # A box's bounds may change for training on; a saved policy acts in the box it was
    # trained in: a wider box holds its actions, a narrower one made the env refuse them.
    wide = GroupSpec(("a0", "a1"), (4,), ActionSpec.box((-2.0, -1.0), (2.0, 1.0)), False)
    boxed = spec_to_dict(EnvSpec({"agents": box}, (8,), 25))
    assert spec_difference(boxed, EnvSpec({"agents": wide}, (8,), 25)) is None
    assert spec_difference(boxed, EnvSpec({"agents": wide}, (8,), 25), bounds=True) is None
    narrow = spec_to_dict(EnvSpec({"agents": wide}, (8,), 25))
    assert spec_difference(narrow, EnvSpec({"agents": box}, (8,), 25), bounds=True) == (
        "group 'agents': the action box [(-1.0, -1.0), (1.0, 1.0)] now is narrower than "
        "[(-2.0, -1.0), (2.0, 1.0)] when trained"
    )
    f32 = GroupSpec(("a0", "a1"), (4,), ActionSpec.box((-0.1, -1.0), (0.1, 1.0)), False)
    near = GroupSpec(("a0", "a1"), (4,), ActionSpec.box((-0.1000000015, -1.0), (0.1, 1.0)), False)
    trained = spec_to_dict(EnvSpec({"agents": near}, (8,), 25))  # (float32's 0.1, read back)
    assert spec_difference(trained, EnvSpec({"agents": f32}, (8,), 25), bounds=True) is None
    # Bounds beyond float32's range are inf to the networks: tanh squashing cannot take them.
    assert ActionSpec.box((-1.0,), (1.0,)).bounded
    assert not ActionSpec.box((-1e39,), (1e39,)).bounded


def test_an_env_keyword_argument_may_be_called_target() -> None:
    """The python: scheme's own first parameter is positional only (a 'target' keyword for the
    env was a TypeError: multiple values for argument 'target')."""
    from mappo.envs import make

    env = make("python:toy_env:TargetEnv", num_envs=2, target=3)
    assert env.target == 3


def test_an_env_of_ones_own_that_raises_is_one_line(user_folder, tmp_path, capsys, monkeypatch):
    """A user's env raising in reset or step is named in one line with the method (exit 2);
    MAPPO_DEBUG=1 shows the traceback instead. The library's own envs are not wrapped."""
    from toy_env import MatchEnv

    class Broken(MatchEnv):
        def _step(self, actions: dict) -> EnvStep:
            raise ZeroDivisionError("my physics exploded\nsecond line")

    env = Broken(num_envs=2)
    env.reset(seed=0)
    with pytest.raises(EnvError) as info:
        env.step({"agents": torch.zeros(2, 2, 1, dtype=torch.long)})
    assert str(info.value) == (
        "toy/match: step() raised ZeroDivisionError: my physics exploded (MAPPO_DEBUG=1 shows "
        "the traceback)"
    )
    assert isinstance(info.value.__cause__, ZeroDivisionError)

    (user_folder / "raising_envs.py").write_text(
        "from toy_env import MatchEnv\n"
        "class ResetRaises(MatchEnv):\n"
        "    def reset(self, seed=None):\n"
        "        raise KeyError('oops')\n"
    )
    argv = ["train", "mpe/simple_spread_fast", "env.name=python:raising_envs:ResetRaises", *TINY]
    argv = [*argv[:-1], f"run_dir={tmp_path / 'runs'}"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "mappo: error: python:raising_envs:ResetRaises: reset() raised KeyError: 'oops' "
        "(MAPPO_DEBUG=1 shows the traceback)\n"
    )
    monkeypatch.setenv("MAPPO_DEBUG", "1")
    with pytest.raises(EnvError) as info:
        main(argv)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_failed_evaluation_keeps_the_training_before_it(user_folder, tmp_path, capsys) -> None:
    """An env that raises only in the evaluation (its own env copy, of eval_episodes envs)
    loses nothing trained: the iteration is saved before the one-line error, which says where
    and what to do next (evaluate after the last iteration, resume before it)."""
    (user_folder / "eval_fails.py").write_text(
        "from toy_env import MatchEnv\n"
        "class FailsInEval(MatchEnv):\n"
        "    def _step(self, actions):\n"
        "        if self.num_envs == 3:\n"
        "            raise RuntimeError('only the eval env breaks')\n"
        "        return super()._step(actions)\n"
    )
    root = tmp_path / "runs"
    base = ["train", "mpe/simple_spread_fast", "env.name=python:eval_fails:FailsInEval"]
    base += ["env.num_envs=4", "eval_episodes=3", "progress=false", "algo.epochs=1"]
    base += ["env.kwargs={}", "checkpoint_interval=1000", f"run_dir={root}"]
    # the final evaluation
    assert main([*base, "total_env_steps=300", "eval_interval=0"]) == 2
    run = _one_run(root)
    (saved,) = (run / "checkpoints").glob("iter_*.pt")
    err = capsys.readouterr().err
    assert err.startswith(
        "mappo: error: python:eval_fails:FailsInEval: step() raised RuntimeError: only the eval "
        "env breaks (MAPPO_DEBUG=1 shows the traceback); the evaluation at env step "
    )
    assert err.endswith(
        f"failed; the training up to it is saved in {saved}; evaluate it with: mappo eval {run} "
        "--import eval_fails\n"
    )
    assert main(["eval", str(run), "--import", "eval_fails", "--episodes", "2", "--json"]) == 0
    capsys.readouterr()
    # an evaluation before the end: the run resumes from the saved iteration
    shutil.rmtree(root)
    assert main([*base, "total_env_steps=600", "eval_interval=1"]) == 2
    run = _one_run(root)
    (saved,) = (run / "checkpoints").glob("iter_*.pt")
    assert capsys.readouterr().err.endswith(
        f"failed; the training up to it is saved in {saved}; continue with: mappo train "
        f"--resume {run} --import eval_fails\n"
    )
    # the iteration's training row is logged (a resume does not redo it: it was a gap)
    with (run / "metrics.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["iteration"] == "1" and row["train/episode_return"] != ""
    # stacked seeds: every seed saves the iteration, so that they resume together
    shutil.rmtree(root)
    assert main([*base, "total_env_steps=600", "eval_interval=1", "num_seeds=2"]) == 2
    err = capsys.readouterr().err
    runs = sorted(p.parent for p in root.glob("**/checkpoints"))
    assert len(runs) == 2
    assert [[c.name for c in (r / "checkpoints").glob("iter_*.pt")] for r in runs] == [
        ["iter_00000001.pt"],
        ["iter_00000001.pt"],
    ]
    # each seed logged its row, and the fix names every seed's folder (they resume together)
    for r in runs:
        with (r / "metrics.csv").open() as f:
            assert [row["iteration"] for row in csv.DictReader(f)] == ["1"]
    assert err.rstrip().endswith(f"--resume {runs[0]} {runs[1]} --import eval_fails")
    # resumed together, they train to the end, where the final evaluation fails again
    resume = ["train", "--resume", *map(str, runs), "--import", "eval_fails", "eval_interval=0"]
    assert main([*resume, "progress=false"]) == 2
    assert "the evaluation at env step 600 failed" in capsys.readouterr().err
    assert [sorted(c.name for c in (r / "checkpoints").glob("iter_*.pt"))[-1] for r in runs] == [
        "iter_00000006.pt",
        "iter_00000006.pt",
    ]


def test_register_refuses_names_that_could_not_be_made_or_replace_a_built_in(
    user_folder, capsys
) -> None:
    """A registered name with a ':' would be read as a scheme, and one that replaces a built-in
    env would make runs that open as the built-in env in another process; a name of one's own
    may be registered again (a module imported twice)."""
    from toy_env import MatchEnv

    for bad in ("", " padded", "my:env", "python:x:Y"):
        with pytest.raises(EnvError, match="cannot register the env name"):
            registry.register(bad, MatchEnv)
    with pytest.raises(EnvError) as info:
        registry.register("mpe/simple_spread", MatchEnv)
    assert str(info.value) == (
        "cannot register 'mpe/simple_spread': it is a built-in env of mappo; register yours "
        "under a name of its own, e.g. 'my_project/simple_spread'"
    )
    assert make("mpe/simple_spread", num_envs=2).name == "mpe/simple_spread"
    # a built-in class with other arguments is the user's env all the same
    from mappo.envs.mpe import SimpleSpread

    with pytest.raises(EnvError, match="cannot register 'mpe/simple_spread': it is a built-in"):
        registry.register("mpe/simple_spread", functools.partial(SimpleSpread, num_agents=4))
    assert make("mpe/simple_spread", num_envs=2).spec.groups["agents"].num_agents == 3
    # what cannot make an env is refused when registered, or when it makes something else
    for bad in (MatchEnv(num_envs=1), 42):
        with pytest.raises(EnvError, match="give a BatchedEnv subclass, or a function"):
            registry.register(f"mine/{uuid.uuid4().hex[:6]}", bad)
    odd = f"mine/{uuid.uuid4().hex[:6]}"
    registry.register(odd, lambda **kw: object())
    with pytest.raises(EnvError, match=f"environment '{odd}' was made as a object, not a Batch"):
        make(odd)
    # a TypeError inside a constructor that took its arguments is the env's, not a parameter's
    registry.register(odd, lambda num_envs, device, seed: len(5))
    with pytest.raises(EnvError, match=f"environment '{odd}' raised TypeError: object of type"):
        make(odd)
    with pytest.raises(EnvError, match=f"bad parameter for environment '{odd}'"):
        make(odd, colour=3)
    name = f"mine/{uuid.uuid4().hex[:6]}"
    registry.register(name, MatchEnv)
    registry.register(name, MatchEnv)
    assert make(name, num_envs=2).spec == MatchEnv(num_envs=2).spec
    # the module of a user who picked a built-in's name: one line from the command line
    (user_folder / "shadowing.py").write_text(
        "from mappo.envs import register\n"
        "from toy_env import MatchEnv\n"
        "register('smac/3m', MatchEnv)\n"
    )
    assert main(["list", "--import", "shadowing"]) == 2
    assert capsys.readouterr().err == (
        "mappo: error: --import shadowing: importing module 'shadowing' raised EnvError: cannot "
        "register 'smac/3m': it is a built-in env of mappo; register yours under a name of its "
        "own, e.g. 'my_project/3m'; fix the error in that module\n"
    )


def test_eval_gif_of_an_env_that_cannot_draw_fails_before_evaluating(user_folder, tmp_path, capsys):
    """The --gif of an env without render() is refused before the evaluation runs (it ran all
    episodes and printed them, then exited 2), and nothing is written."""
    (user_folder / "plain_envs.py").write_text("from toy_env import MatchEnv as Plain\n")
    root = tmp_path / "runs"
    argv = ["train", "mpe/simple_spread_fast", "env.name=python:plain_envs:Plain", *TINY]
    assert main([*argv[:-1], "env.kwargs={}", f"run_dir={root}"]) == 0
    capsys.readouterr()
    gif = tmp_path / "plain.gif"
    assert main(["eval", str(_one_run(root)), "--import", "plain_envs", "--gif", str(gif)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not gif.exists()
    assert err == (
        "mappo: error: environment 'python:plain_envs:Plain' cannot render frames (MatchEnv does "
        "not implement render()); no GIF can be made of it "
        "(`mappo eval` evaluates it without one)\n"
    )


def test_a_run_that_fails_before_training_anything_leaves_no_folder(user_folder, tmp_path, capsys):
    """An env that raises in its first step: the new run folder (config.yaml, a TensorBoard
    file, the lock, and nothing to resume or evaluate) is removed with the error; a folder the
    caller gave that held files keeps them."""
    (user_folder / "step_fails.py").write_text(
        "from toy_env import MatchEnv\n"
        "class StepFails(MatchEnv):\n"
        "    def _step(self, actions):\n"
        "        raise RuntimeError('broken step')\n"
    )
    root = tmp_path / "runs"
    argv = ["train", "mpe/simple_spread_fast", "env.name=python:step_fails:StepFails", *TINY]
    assert main([*argv[:-1], "env.kwargs={}", f"run_dir={root}"]) == 2
    assert "step() raised RuntimeError: broken step" in capsys.readouterr().err
    assert list(root.iterdir()) == []
    from mappo.trainer import train

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    overrides = {"env.name": "python:step_fails:StepFails", "env.kwargs": {}, "progress": False}
    with pytest.raises(EnvError, match="broken step"):
        train("mpe/simple_spread_fast", overrides, run_dir=mine)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_a_notebooks_adapter_class_in_worker_processes_names_the_fix():
    """A PettingZoo env class defined in a notebook (here `python -c`, which has no script file
    either) cannot be built by worker processes; the one-line error says what to do."""
    import subprocess

    pytest.importorskip("mpe2")
    code = (
        "import mappo\n"
        "from mpe2 import simple_spread_v3\n"
        "class MyPZ:\n"
        "    def __new__(cls, **kw):\n"
        "        return simple_spread_v3.parallel_env(**kw)\n"
        "try:\n"
        "    mappo.envs.make('pettingzoo:__main__:MyPZ', num_envs=2, num_workers=1)\n"
        "except mappo.EnvError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "cannot reach worker processes: pass env.kwargs.num_workers=0" in done.stdout, (
        done.stdout + done.stderr
    )


def test_observations_of_images_size_are_named_before_training():
    """An env whose agents observe more than 10,000 values (images: a butterfly game's 403,200
    pixels) is told that the networks read them flat, with the weights that takes."""
    import warnings

    from toy_env import MatchEnv

    from mappo import config as C
    from mappo.trainer import _warn_large_observations

    cfg = C.load("mpe/simple_spread")
    with pytest.warns(UserWarning, match="observes 10,002 values per agent .*640,128 weights"):
        _warn_large_observations(cfg, MatchEnv(1, num_actions=10_001))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_large_observations(cfg, MatchEnv(1))


def _late_fault_module(folder: Path, module: str, after: int, fault: str) -> None:
    """Write ``module``: the toy env whose ``_step`` runs the statement ``fault`` on its step's
    output from its ``after + 1``-th call on (counted over every copy in the process)."""
    (folder / f"{module}.py").write_text(
        "import torch\n"
        "from toy_env import MatchEnv\n"
        "class Late(MatchEnv):\n"
        "    calls = 0\n"
        "    def _step(self, actions):\n"
        "        step = super()._step(actions)\n"
        "        Late.calls += 1\n"
        f"        if Late.calls > {after}:\n"
        f"            {fault}\n"
        "        return step\n"
    )


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("shape", r"step\(\): obs\['agents'\] has shape \[4, 2, 4\]"),
        ("stat", "stats has no 'accuracy'"),
    ],
)
def test_a_mistake_after_the_checked_outputs_is_named_in_one_line(
    user_folder, tmp_path, capsys, fault, message
) -> None:
    """Only an env's first outputs are checked; a mistake that shows later (an observation of
    another shape once agents die, a statistic left out) is named by the check of the output it
    came in when training fails on it, instead of a traceback from where the rollout stored it
    (or, for the statistic, an average of zeros)."""
    module = f"late_{fault}_envs"  # (a module of its own per case: imports are cached)
    _late_fault_module(
        user_folder,
        module,
        30,
        "step.obs = {'agents': step.obs['agents'][..., :4]}"
        if fault == "shape"
        else "step.stats = {}",
    )
    argv = ["train", "mpe/simple_spread_fast", f"env.name=python:{module}:Late", *TINY]
    argv = [*argv[:-1], "total_env_steps=800", f"run_dir={tmp_path / 'runs'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


@pytest.mark.parametrize(
    ("fault", "after", "code", "message"),
    [
        (
            "none",
            30,
            2,
            r"step\(\) returned final_obs=None, which bootstrapping truncated episodes",
        ),
        ("shape", 30, 2, r"step\(\): final_state has shape \[4, 5\], the spec asks for \[4, 10\]"),
        ("nan", 30, 3, r"because the env returned NaN or inf \(final_obs or final_state of group"),
        ("state", 30, 3, r"because the env returned NaN or inf \(state of group 'agents'\)"),
        # within the first, checked, outputs: named before anything is trained
        ("none", 0, 2, r"returned final_obs=None, which bootstrapping"),
        ("nan", 0, 2, r"step\(\): final_state holds NaN or inf"),
    ],
)
def test_the_pre_reset_fields_of_a_users_env_are_checked(
    user_folder, tmp_path, capsys, fault, after, code, message
) -> None:
    """final_obs / final_state, which a critic bootstrapping truncated episodes reads: left
    out, of another shape or not finite, each is named in one line (by the check of the first
    outputs, or where training fails later) instead of a traceback or a divergence blamed on
    the learning rates."""
    module = f"final_{fault}_{after}_envs"
    faults = {
        "none": "step.final_obs, step.final_state = None, None",
        "shape": "step.final_state = step.final_state[:, :5]",
        "state": "step.state = torch.full_like(step.state, float('nan'))",
        "nan": "step.final_state = torch.full_like(step.final_state, float('nan'))",
    }
    _late_fault_module(user_folder, module, after, faults[fault])
    argv = ["train", "mpe/simple_spread_fast", f"env.name=python:{module}:Late", *TINY]
    argv = [*argv[:-1], "total_env_steps=800", "algo.bootstrap_truncation=true"]
    assert main([*argv, f"run_dir={tmp_path / 'runs'}"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


def test_check_output_names_missing_or_misshapen_pre_reset_fields() -> None:
    """Where an episode ended, final_obs and final_state must be there (the value family's
    episodes end on them); given ones must match obs / state in shape, dtype and finiteness."""
    from toy_env import MatchEnv

    from mappo.envs.base import check_output

    env = MatchEnv(num_envs=2, episode_limit=1)
    env.reset()
    step = env.step({"agents": torch.zeros(2, 2, 1, dtype=torch.int64)})
    assert bool(step.truncated.all())
    check_output(env, step)
    good_obs, good_state = step.final_obs, step.final_state
    step.final_obs = None
    with pytest.raises(EnvError, match="an episode ended in this step but final_obs is None"):
        check_output(env, step)
    step.final_obs = {"agents": good_obs["agents"].double()}
    with pytest.raises(EnvError, match=r"final_obs\['agents'\] has dtype torch.float64"):
        check_output(env, step)
    step.final_obs = {"agents": good_obs["agents"][:, :1]}
    with pytest.raises(EnvError, match=r"final_obs\['agents'\] has shape \[2, 1, 5\]"):
        check_output(env, step)
    step.final_obs, step.final_state = good_obs, good_state * float("inf")
    with pytest.raises(EnvError, match="final_state holds NaN or inf"):
        check_output(env, step)


def test_a_users_env_that_skips_batchedenvs_init_or_returns_no_envstep_later_is_named() -> None:
    """A subclass whose __init__ forgets super().__init__ (a traceback from the memory check
    before), and a step() that returns something else after the checked outputs (a traceback
    from reading its masks before)."""
    from toy_env import MatchEnv

    class NoSuper(MatchEnv):
        def __init__(self, num_envs: int, device: str = "cpu", seed: int = 0) -> None:
            self.spec = MatchEnv(1).spec

    name = f"mine/{uuid.uuid4().hex[:6]}"
    registry.register(name, NoSuper)
    with pytest.raises(EnvError, match=r"NoSuper.__init__ did not call BatchedEnv's: start it"):
        make(name)

    class Later(MatchEnv):
        calls = 0

        def _step(self, actions):  # noqa: ANN001, ANN202
            Later.calls += 1
            step = super()._step(actions)
            return vars(step) if Later.calls > 10 else step

    env = Later(num_envs=1)
    env.reset()
    with pytest.raises(EnvError, match="step\\(\\) must return an EnvStep, got dict"):
        for _ in range(12):
            env.step({"agents": torch.zeros(1, 2, 1, dtype=torch.int64)})


@pytest.mark.parametrize("preset", ["mpe/simple_spread_fast", "mpe/simple_spread_qmix"])
def test_episodes_past_the_declared_limit_stop_training_at_once(
    user_folder, tmp_path, capsys, preset
) -> None:
    """An env that runs its episodes past spec.episode_limit (here: never ends them in a run's
    budget) is named after the first iteration, not at the first evaluation, after the whole
    budget."""
    (user_folder / "endless_envs.py").write_text(
        "from toy_env import MatchEnv\n"
        "class Endless(MatchEnv):\n"
        "    def __init__(self, **kwargs):\n"
        "        super().__init__(**kwargs)\n"
        "        self.limit = 10**6  # the spec still says 6\n"
    )
    tiny = [w for w in TINY[:-1] if not w.startswith("algo.")]  # (qmix has no epochs)
    argv = ["train", preset, "env.name=python:endless_envs:Endless", *tiny]
    argv += ["total_env_steps=100000", "eval_interval=0", f"run_dir={tmp_path / 'runs'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.search(r"an episode has run \d+ steps, past spec.episode_limit=6; end each", err)


def test_a_group_spec_with_a_bare_action_count_names_actionspec() -> None:
    from mappo.envs import GroupSpec

    with pytest.raises(TypeError, match=r"must be an ActionSpec, e.g. ActionSpec\(\(3,\)\)"):
        GroupSpec(agents=("a",), obs_shape=(3,), action=3)  # type: ignore[arg-type]


def test_naming_an_installed_module_keeps_the_current_directory_off_the_path(user_folder):
    """Only a module found in the current directory puts it on sys.path: naming an installed
    one (--import os.path) must not let a file there shadow a package imported later."""
    from mappo.envs.importing import require_module

    (user_folder / "not_installed_anywhere.py").write_text("raise SystemExit('ran')\n")
    require_module("--import os.path", "os.path")
    assert str(user_folder) not in sys.path
    with pytest.raises(ModuleNotFoundError):
        __import__("not_installed_anywhere")
    (user_folder / "mine_here.py").write_text("VALUE = 3\n")
    assert require_module("--import mine_here", "mine_here").VALUE == 3
    assert str(user_folder) in sys.path
