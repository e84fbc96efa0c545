"""What a run needs of the machine: the memory estimate and the thread governor."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from mappo import config as C
from mappo.envs.registry import make
from mappo.resources import (
    ThreadGovernor,
    env_state_bytes,
    estimate_bytes,
    format_bytes,
    memory_problem,
    step_bytes,
)


def test_step_bytes_counts_every_per_step_tensor():
    with make("mpe/simple_spread", num_envs=2) as env:
        spec = env.spec
    g = spec.groups["agents"]
    expected = 4 * (
        spec.state_shape[0] + 4 + g.num_agents * (g.obs_shape[0] + g.action.total + 1 + 4)
    )
    assert step_bytes(spec) == expected


def test_estimate_grows_with_the_fields_that_size_it():
    cfg = C.load("mpe/simple_spread_fast")
    with make("mpe/simple_spread", num_envs=2) as env:
        spec, state = env.spec, env_state_bytes(env)
    assert state > 0  # the particle world exports its state
    small = estimate_bytes(cfg, spec, state)
    cfg.env.num_envs *= 10
    big = estimate_bytes(cfg, spec, state)
    assert big["env.num_envs"] == 10 * small["env.num_envs"]
    assert big["eval_episodes"] == small["eval_episodes"]


@pytest.mark.parametrize(
    ("preset", "extra"),
    [
        ("smac/3m_qmix", []),
        ("mpe/simple_spread_qmix", []),
        # observations and states kept as bytes (the env declares byte observations)
        ("hanabi/full-2p_fast", ["algo.name=vdn", "env.name=hanabi/very-small-2p"]),
    ],
)
def test_buffer_estimate_matches_the_real_buffer(preset, extra):
    """The estimate is what the replay buffer really allocates (a lower bound, never more)."""
    from mappo.learners import make_learner

    cfg = C.load(preset, ["algo.buffer_size=64", "env.num_envs=2", *extra])
    with make(cfg.env.name, num_envs=cfg.env.num_envs, **cfg.env.kwargs) as env:
        learner = make_learner(cfg, env)
        real = sum(
            t.numel() * t.element_size()
            for v in learner.buffer.storage.fields().values()
            for t in (v.values() if isinstance(v, dict) else [v])
        )
        estimate = estimate_bytes(cfg, env.spec, env_state_bytes(env), env.byte_observations)
    assert estimate["algo.buffer_size"] == real


def test_memory_problem_names_the_biggest_part():
    cfg = C.load("mpe/simple_spread_fast", ["env.num_envs=1000000"])
    with make("mpe/simple_spread", num_envs=1) as env:
        spec, state = env.spec, env_state_bytes(env)
    assert memory_problem(cfg, spec, state, free=None) is None  # unknown: no refusal
    assert memory_problem(cfg, spec, state, free=2**50) is None
    msg = memory_problem(cfg, spec, state, free=2**30)
    assert msg is not None and "env.num_envs=1,000,000" in msg and "1.0 GB is free" in msg
    assert "\n" not in msg


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KB"
    assert format_bytes(3 * 2**40) == "3.0 TB"


def _scripted(gov: ThreadGovernor, samples: list[tuple[float, float, float]]) -> None:
    it = iter(samples)
    gov._sample = lambda: next(it)  # type: ignore[method-assign]


def test_governor_counts_only_other_processes():
    before = torch.get_num_threads()
    try:
        gov = ThreadGovernor(probe=0.0)
        gov.cores = gov.most = 4
        gov.last = (0.0, 0.0, 0.0)
        # Each sample: (wall s, busy CPU-s of the machine, CPU-s of this process).
        # 10 s, machine busy 30 CPU-s of which 20 ours: others hold one core, three are free.
        # Then others use nothing (all ours): four; then others hold two cores: two.
        _scripted(gov, [(10.0, 30.0, 20.0), (20.0, 70.0, 60.0), (30.0, 100.0, 70.0)])
        assert gov.update(force=True) == 3 and torch.get_num_threads() == 3
        assert gov.update(force=True) == 4 and torch.get_num_threads() == 4
        assert gov.update(force=True) == 2 and torch.get_num_threads() == 2
        # Within the interval nothing is measured (the scripted samples are used up).
        gov.last = (time.monotonic(), *gov.last[1:])
        assert gov.update() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the governor reads /proc/stat")
def test_governor_leaves_a_core_to_a_busy_process():
    before = torch.get_num_threads()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        gov = ThreadGovernor(probe=1.0)
        assert gov.threads is not None
        assert 1 <= gov.threads <= max(1, (gov.cores or 1) - 1)
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(before)


def test_a_value_familys_gradient_step_counts_its_batch():
    """QMIX's batch of episodes (the sample and the networks' activations over it) is sized
    by algo.batch_size: a batch far beyond the machine is refused before the run starts, not
    once the buffer has filled hours later."""
    cfg = C.load("smac/3m_qmix", ["algo.batch_size=100000", "algo.buffer_size=100000"])
    with make(cfg.env.name, num_envs=1, **cfg.env.kwargs) as env:
        spec, state = env.spec, env_state_bytes(env)
    parts = estimate_bytes(cfg, spec, state)
    assert parts["algo.batch_size"] > parts["algo.buffer_size"]  # activations on top
    msg = memory_problem(cfg, spec, state, free=parts["algo.buffer_size"] * 2)
    assert msg is not None and "algo.batch_size=100,000 takes" in msg
    assert msg.endswith("lower algo.batch_size")
