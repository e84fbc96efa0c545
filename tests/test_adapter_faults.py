"""Faults of the adapters' worker processes: an env that raises, hangs or is killed is reported
with the env's name, the worker index and the original error, and no process is left behind
(on errors, on Ctrl-C, on close, at exit, and when the main process is killed)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch
from test_adapter_envs import pid_alive, tiny

from mappo.envs import EnvError, make
from mappo.envs.adapters import EnvWorkerError, PettingZooAdapter
from mappo.envs.adapters._worker import copy_seed

pytest.importorskip("pettingzoo")


def ones(env: PettingZooAdapter) -> dict[str, torch.Tensor]:
    return {"agent": torch.ones(env.num_envs, 2, dtype=torch.int64)}


def wait_until_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    """The pids still alive after waiting up to ``seconds`` (normally none, at once)."""
    deadline = time.monotonic() + seconds
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def shm_exists(name: str) -> bool:
    try:
        block = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    block.close()
    return True


def assert_cleaned_up(pids: list[int], shm_name: str) -> None:
    assert len(pids) == 2
    assert wait_until_gone(pids) == []
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)
    assert not shm_exists(shm_name)


def started(**kwargs: object) -> tuple[PettingZooAdapter, list[int], str]:
    """Four copies on two workers (copies 0-1 on worker 0, 2-3 on worker 1), reset."""
    timeout = kwargs.pop("timeout", 60.0)
    env = PettingZooAdapter(tiny(**kwargs), num_envs=4, num_workers=2, timeout=timeout, name="tiny")
    env.reset(seed=0)
    return env, env.worker_pids, env._buffers.name


def test_an_env_that_raises_is_reported_with_its_traceback() -> None:
    env, pids, shm = started(fault="raise", fault_seed=copy_seed(0, 3))  # copy 3
    env.step(ones(env))
    with pytest.raises(EnvWorkerError) as info:
        env.step(ones(env))
    err = info.value
    assert (err.env_name, err.worker, err.env_index) == ("tiny", 1, 3)
    assert str(err).startswith("tiny: the environment raised RuntimeError: boom at step 2")
    assert "worker 1" in str(err) and "copy 3" in str(err)
    # one line: the worker's traceback only with MAPPO_DEBUG=1
    assert "\n" not in str(err) and str(err).endswith("(MAPPO_DEBUG=1 shows the traceback)")
    assert "test_adapter_envs.py" in err.remote_traceback and "in step" in err.remote_traceback
    assert_cleaned_up(pids, shm)
    with pytest.raises(EnvError, match="closed after an error"):
        env.step(ones(env))


def test_a_hanging_env_is_reported_after_the_timeout_with_its_stack() -> None:
    env, pids, shm = started(fault="hang", fault_seed=copy_seed(0, 0), timeout=2.0)
    env.step(ones(env))
    with pytest.raises(EnvWorkerError, match="worker 0 .* did not finish step within 2 s") as info:
        env.step(ones(env))
    if hasattr(signal, "SIGUSR1"):
        assert "_hang_forever" in info.value.remote_traceback
    assert_cleaned_up(pids, shm)


def test_a_timeout_needs_worker_processes() -> None:
    # In-process nothing could interrupt a hanging step, so an explicit timeout is refused,
    # even one equal to the default value, before any env is built.
    expected = (
        "tiny: timeout needs worker processes: with num_workers=0 a hanging step cannot be "
        "interrupted; set num_workers>=1 or drop timeout"
    )
    hangs = tiny(fault="hang", fault_seed=copy_seed(0, 0))
    for timeout in (2.0, 60):
        with pytest.raises(EnvError) as info:
            PettingZooAdapter(hangs, num_envs=2, num_workers=0, timeout=timeout, name="tiny")
        assert str(info.value) == expected
    # The same through a config name, where the adapter options come with the env kwargs.
    with pytest.raises(EnvError, match="^pettingzoo:test_adapter_envs:TinyEnv: timeout needs"):
        make("pettingzoo:test_adapter_envs:TinyEnv", num_envs=1, num_workers=0, timeout=5)
    # Without an explicit timeout the envs run in-process as before.
    with PettingZooAdapter(tiny(), num_envs=2, num_workers=0, name="tiny") as env:
        env.reset(seed=0)
        assert env.step(ones(env)).reward["agent"].shape == (2, 2)
    # The fix the message names works: one worker, and the hanging step is stopped in time.
    env = PettingZooAdapter(hangs, num_envs=2, num_workers=1, timeout=1.0, name="tiny")
    pids, shm = env.worker_pids, env._buffers.name
    env.reset(seed=0)
    env.step(ones(env))
    start = time.monotonic()
    with pytest.raises(EnvWorkerError, match="worker 0 .* did not finish step within 1 s"):
        env.step(ones(env))
    assert time.monotonic() - start < 30
    assert wait_until_gone(pids) == [] and not shm_exists(shm)


def test_a_killed_worker_is_reported() -> None:
    env, pids, shm = started()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(EnvWorkerError, match="tiny: worker 1 .* was killed by SIGKILL") as info:
        env.step(ones(env))
    assert info.value.worker == 1
    assert_cleaned_up(pids, shm)


def test_ctrl_c_during_a_step_stops_the_workers() -> None:
    env, pids, shm = started(fault="hang", fault_seed=copy_seed(0, 2))

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        env.step(ones(env))
        with pytest.raises(KeyboardInterrupt):
            env.step(ones(env))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert_cleaned_up(pids, shm)


def test_close_and_the_context_manager_end_the_workers() -> None:
    with PettingZooAdapter(tiny(), num_envs=2, envs_per_worker=1) as env:
        pids, shm = env.worker_pids, env._buffers.name
        assert env.num_workers == 2 and all(pid_alive(p) for p in pids)
        env.reset()
        env.step(ones(env))
    assert_cleaned_up(pids, shm)
    env.close()  # idempotent


SCRIPT = """
import os, signal, sys
from mappo.envs.adapters import PettingZooAdapter
from test_adapter_envs import tiny

if __name__ == "__main__":
    env = PettingZooAdapter(tiny(), num_envs=2, num_workers=2)
    env.reset()
    print(*env.worker_pids, env._buffers.name, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": leave without close()
"""


def test_no_worker_outlives_the_main_process(tmp_path: Path) -> None:
    """At a normal exit without close(), and when the main process is killed with SIGKILL."""
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(SCRIPT))
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    runs = {
        mode: subprocess.Popen(
            [sys.executable, str(script), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in ("exit", "kill")
    }
    for mode, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == (0 if mode == "exit" else -signal.SIGKILL), err
        *words, shm = out.split()
        pids = [int(p) for p in words]
        if mode == "exit":
            assert_cleaned_up(pids, shm)
            assert "Traceback" not in err and "leaked" not in err and "ignored" not in err, err
        else:
            # The workers see the main process die and exit; the shared memory is reclaimed
            # by multiprocessing's resource tracker once they are gone.
            assert wait_until_gone(pids) == []
            deadline = time.monotonic() + 10
            while shm_exists(shm) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not shm_exists(shm)


UNGUARDED = """
from mappo.envs.adapters import PettingZooAdapter
from test_adapter_envs import tiny

env = PettingZooAdapter(tiny(), num_envs=1, num_workers=1, start_method="spawn")
env.reset()
"""


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path: Path) -> None:
    # Under spawn (macOS's and Windows' way) each worker imports the main script, which here
    # starts workers again; the message named picklable factories, which is not the cause.
    script = tmp_path / "main.py"
    script.write_text(UNGUARDED, encoding="utf-8")
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode != 0
    assert 'put the code that trains under `if __name__ == "__main__":`' in out.stderr
    assert "must be picklable" not in out.stderr


def test_workers_start_by_spawn_on_macos(monkeypatch) -> None:
    from mappo.envs.adapters import pool

    assert pool.default_start_method() == "forkserver"  # Linux
    monkeypatch.setattr(pool.sys, "platform", "darwin")
    assert pool.default_start_method() == "spawn"
