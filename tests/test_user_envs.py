"""Environments of the user's own on the command line: ``python:<module>:<class>`` names and
``--import MODULE``, so that a run of such an env trains, evaluates, renders and resumes from
``mappo`` like a built-in one; and the errors of a name that cannot be built."""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import pytest

from mappo.cli import main
from mappo.envs import EnvError, make, registry

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
    # A later process knows nothing of the module: the name alone rebuilds the env.
    sys.modules.pop(module)
    assert main(["eval", str(run), "--episodes", "3", "--json"]) == 0
    result = capsys.readouterr().out
    assert '"eval_hits"' in result and '"eval_episodes": 3.0' in result
    assert main(["train", "--resume", str(run), "total_env_steps=500", "progress=false"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*.pt"))[-1] > "iter_00000003"
    capsys.readouterr()
    assert main(["bench", "env", "--envs", name, "--num-envs", "2", "--seconds", "0.01"]) == 0
    assert name in capsys.readouterr().out
    # The docs' example draws nothing: render says so in one line and writes no file.
    assert main(["render", name, "--gif", str(tmp_path / "a.gif")]) == 2
    err = capsys.readouterr().err
    assert "cannot render frames (GuessTheColor does not implement render())" in err
    assert not (tmp_path / "a.gif").exists()


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
    assert "python:<module>:<class>" in err and "--import <module>" in err

    assert main(["eval", str(run), "--episodes", "2", "--import", module]) == 0
    assert "eval_hits" in capsys.readouterr().out
    assert main(["list", "--import", module]) == 0
    assert env_name in capsys.readouterr().out
    bench = ["bench", "env", "--envs", env_name, "--num-envs", "2", "--seconds", "0.01"]
    assert main([*bench, "--no-pettingzoo", "--import", module]) == 0
    assert env_name in capsys.readouterr().out


BAD_NAMES = [
    ("python:user_mod", "'python:user_mod' names no callable: write python:<module>:<class"),
    ("python::Thing", "names no callable"),
    ("python:no_such_module_xyz:Env", "module 'no_such_module_xyz' is not importable; is its"),
    ("python:bad-name:Env", "'bad-name' is not a module name"),
    ("python:user_mod:Nope", "python:user_mod:Nope: 'user_mod' has no attribute 'Nope'"),
    ("python:user_mod:Env.nope", "'user_mod.Env' has no attribute 'nope'"),
    ("python:user_mod:VALUE", "'user_mod.VALUE' is a int, not a class or function"),
    ("python:user_mod:no_kwargs", "bad parameter for environment 'python:user_mod:no_kwargs'"),
    ("python:user_mod:not_an_env", "returned a dict, not a mappo.envs.BatchedEnv"),
    ("python:user_mod:parallel", "for a PettingZoo ParallelEnv use pettingzoo:user_mod:parallel"),
    ("python:user_raises:Env", "importing module 'user_raises' raised RuntimeError: broken"),
]


@pytest.mark.parametrize(("name", "message"), BAD_NAMES)
def test_python_names_that_cannot_be_built_are_one_line(user_folder, name, message) -> None:
    (user_folder / "user_mod.py").write_text(
        "VALUE = 3\n"
        "class Env:\n    pass\n"
        "def no_kwargs():\n    return None\n"
        "def not_an_env(**kwargs):\n    return dict(kwargs)\n"
        "class _Parallel:\n    possible_agents = ['a']\n"
        "def parallel(**kwargs):\n    return _Parallel()\n"
    )
    (user_folder / "user_raises.py").write_text("raise RuntimeError('broken\\nsecond line')\n")
    for module in ("user_mod", "user_raises"):
        sys.modules.pop(module, None)
    with pytest.raises(EnvError) as info:
        make(name, num_envs=2)
    assert message in str(info.value) and "\n" not in str(info.value)


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
    assert main(["eval", str(tmp_path / "runs" / "python")]) == 2
    err = capsys.readouterr().err
    assert f"holds a run below it; give one run directory, e.g. '{old}'" in err
    assert main(["train", "--resume", str(tmp_path / "runs" / "empty")]) == 2
    assert "runs/empty' a mappo run directory?" in capsys.readouterr().err
