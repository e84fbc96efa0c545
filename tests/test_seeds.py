"""Many seeds in one process (``num_seeds``, :mod:`mappo.learners.seeds`): seed k of a stacked
run learns what a single run of seed k learns, keeps a single run's checkpoints, and resumes
alone or together.

The equality tests run on the CPU; ``MAPPO_TEST_DEVICE=cuda`` runs them on a GPU."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mappo import config as config_mod
from mappo.cli import main
from mappo.compiled import fuses_env_step
from mappo.config import ConfigError
from mappo.envs.registry import make
from mappo.learners.seeds import OneEnvBlocks, StackedPPOLearner, make_seed_envs, seed_grad_norms
from mappo.trainer import Trainer, resume, resume_seeds, train, train_seeds

# Rounding of batched against plain matrix multiplies, after a few updates (measured: <= 1e-6).
PARAM_TOL = 2e-5
DEVICE = os.environ.get("MAPPO_TEST_DEVICE", "cpu")
SMALL = {
    "env.num_envs": 4,
    "rollout_length": 16,
    "threads": 1,
    "progress": False,
    "device": DEVICE,
}


def _cfg(preset: str, **overrides) -> config_mod.TrainConfig:
    return config_mod.load(preset, {**SMALL, "tensorboard": False, **overrides})


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


CASES = {
    # feed-forward, 4 shuffled mini-batches per epoch
    "ff_minibatches": ("mpe/simple_spread_jaxmarl_ff", {}),
    # the paper's recurrent MAPPO: 64 samples in chunks of 10 (padding, chunks crossing envs)
    "recurrent_padded": ("mpe/simple_spread", {}),
    # two groups (speaker, listener), PopArt rescaling the value heads in place; tanh rather than
    # the preset's ReLU, whose kink turns a last-bit difference in a unit's pre-activation into
    # a different gradient for the whole unit (seen on an AVX-512 CPU: 2.6e-4 after 3 updates)
    "two_groups_popart": (
        "mpe/simple_speaker_listener",
        {"algo.value_norm": "popart", "model.activation": "tanh"},
    ),
    # action masks, death masking, agent-specific state, truncation bootstrap
    "smac_masks": (
        "smac/3m",
        {
            "algo.critic_input": "agent_state",
            "algo.death_masked_critic": True,
            "algo.bootstrap_truncation": True,
        },
    ),
    # a Gaussian policy with per-agent parameters
    "continuous_per_agent": ("mpe/simple_spread_continuous", {"model.share_params": False}),
    # convolutions over image observations and an image state, one set of filters per agent
    # (a grouped convolution under vmap); tanh for the reason above
    "cnn_per_agent": (
        "grid/spread",
        {"model.share_params": False, "model.activation": "tanh", "model.cnn_channels": [4]},
    ),
    # turn-based play (one acting player, the losses on its rows) and a rollout in bytes; tanh
    # for the reason above
    "hanabi_bytes": (
        "hanabi/full-2p_fast",
        {"env.name": "hanabi/small-2p", "model.hidden_sizes": [32, 32], "model.activation": "tanh"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_seed_learns_what_its_single_run_learns(case):
    preset, overrides = CASES[case]
    cfg = _cfg(preset, **overrides)
    cfgs = [dataclasses.replace(cfg, seed=s) for s in (3, 4, 7)]
    blocks = make_seed_envs(cfgs, torch.device(DEVICE))
    stacked = StackedPPOLearner(cfgs, blocks)
    singles = [Trainer(c) for c in cfgs]
    if case == "hanabi_bytes":
        assert stacked.collector.rollout.groups["players"].obs.dtype == torch.uint8
    try:
        for it in range(3):
            results = stacked.iterate(it, 0)
            single_results = [t.iterate() for t in singles]
        for k, t in enumerate(singles):
            got, want = stacked.policies[k].state_dict(), t.policy.state_dict()
            assert _max_diff(got, want) < PARAM_TOL, f"seed {cfgs[k].seed}"
            for key, value in single_results[k].items():
                if key.endswith("_seconds"):
                    continue
                assert results[k][key] == pytest.approx(value, rel=1e-3, abs=1e-4), key
            # episode statistics are per seed, as a single run counts them
            mine, theirs = stacked.seed_tracker(k).read(), t.learner.tracker.read()
            assert mine.keys() == theirs.keys()
            for key in mine:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-4), key
        # the seeds differ from each other (their own initialisations and envs)
        a, b = stacked.policies[0].state_dict(), stacked.policies[1].state_dict()
        assert _max_diff(a, b) > 1e-3
    finally:
        for t in singles:
            t.close()
        blocks.close()


@pytest.mark.parametrize(
    "name", ["mpe/simple_spread", "mpe/simple_reference", "mpe/simple_speaker_listener"]
)
def test_a_particle_world_split_into_seed_blocks_replays_each_seed(name):
    seeds, per = [5, 9, 11], 4
    blocked = make(name, num_envs=per * len(seeds))
    singles = [make(name, num_envs=per) for _ in seeds]
    got = blocked.seed_blocks(seeds)
    want = [env.reset(seed=s) for env, s in zip(singles, seeds, strict=True)]
    g = torch.Generator().manual_seed(0)
    for t in range(60):  # episodes of 25 steps: two auto-resets, whose draws are per block
        for k, w in enumerate(want):
            rows = slice(k * per, (k + 1) * per)
            for group in w.obs:
                assert torch.equal(got.obs[group][rows], w.obs[group]), (t, k, group)
                assert torch.equal(got.reward[group][rows], w.reward[group]), (t, k, group)
            assert torch.equal(got.done[rows], w.done)
        actions = {
            group: torch.stack(
                [
                    torch.randint(0, n, (per * len(seeds), spec.num_agents), generator=g)
                    for n in spec.action.nvec
                ],
                -1,
            )  # fmt: skip
            for group, spec in blocked.spec.groups.items()
        }
        got = blocked.step(actions)
        want = [
            env.step({grp: a[k * per : (k + 1) * per] for grp, a in actions.items()})
            for k, env in enumerate(singles)
        ]
    # an env of other kinds is stepped one seed after another
    cfgs = [_cfg("smac/3m", seed=s) for s in (1, 2)]
    assert not isinstance(make_seed_envs(cfgs, torch.device(DEVICE)), OneEnvBlocks)
    cfgs = [_cfg("mpe/simple_spread", seed=s) for s in (1, 2)]
    assert isinstance(make_seed_envs(cfgs, torch.device(DEVICE)), OneEnvBlocks)


def test_per_seed_gradient_clipping_matches_torch():
    torch.manual_seed(0)
    grads = [torch.randn(3, 4, 5) * s for s in (1.0, 10.0)]
    params = []
    for g in grads:
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g.clone()
        params.append(p)
    norms = seed_grad_norms(params, max_norm=2.0)
    for k in range(3):
        single = [torch.zeros_like(g[k], requires_grad=True) for g in grads]
        for p, g in zip(single, grads, strict=True):
            p.grad = g[k].clone()
        want = torch.nn.utils.clip_grad_norm_(single, 2.0)
        assert float(norms[k]) == pytest.approx(float(want), rel=1e-6)
        for p, q in zip(params, single, strict=True):
            torch.testing.assert_close(p.grad[k], q.grad)


def _steps(cfg: config_mod.TrainConfig, iterations: int) -> int:
    return cfg.steps_per_update * iterations


def test_seed_runs_have_their_own_directories_and_resume_alone_or_together(tmp_path):
    preset = "mpe/simple_spread_jaxmarl_ff"
    # (no learning-rate decay: its schedule depends on total_env_steps, which the resume raises)
    base = {"eval_interval": 1, "eval_episodes": 4, "checkpoint_interval": 1, "num_seeds": 2,
            "algo.lr_decay": False}  # fmt: skip
    cfg = _cfg(preset, **base)
    two, four = _steps(cfg, 2), _steps(cfg, 4)

    first = train_seeds(
        preset, {**SMALL, **base, "total_env_steps": two, "run_dir": str(tmp_path / "a")}
    )
    assert [r.config.seed for r in first] == [1, 2]
    dirs = [r.dir for r in first]
    assert len(set(dirs)) == 2
    for run, seed in zip(first, (1, 2), strict=True):
        saved = config_mod.load(str(run.dir / "config.yaml"))
        assert (saved.seed, saved.num_seeds) == (seed, 1)
        assert (run.dir / "metrics.csv").read_text().count("\n") == 3  # header + 2 updates
        assert run.summary["env_steps"] == two and "eval_return_mean" in run.summary
    alone = tmp_path / "alone"
    shutil.copytree(dirs[1], alone)

    # together, in one process
    together = resume_seeds(dirs, {"total_env_steps": four})
    # seed 2 alone, as a single run, from the same checkpoint
    single = resume(alone, {"total_env_steps": four})
    # both seeds uninterrupted
    straight = train_seeds(
        preset, {**SMALL, **base, "total_env_steps": four, "run_dir": str(tmp_path / "b")}
    )
    for k in range(2):
        got = together[k].policy.state_dict()
        assert _max_diff(got, straight[k].policy.state_dict()) < PARAM_TOL
        assert together[k].summary["env_steps"] == four
    assert _max_diff(single.policy.state_dict(), together[1].policy.state_dict()) < PARAM_TOL
    # a returned seed's networks hold their own storage, not views of all seeds' tensors
    for t in together[0].policy.state_dict().values():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    rows = (dirs[0] / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 5  # the resumed seed appends to its own metrics


def test_stacked_runs_refuse_what_they_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match="num_seeds"):
        config_mod.load("mpe/simple_spread_qmix", {"num_seeds": 2})
    with pytest.raises(ConfigError, match="train_seeds"):
        train("mpe/simple_spread_jaxmarl_ff", {**SMALL, "num_seeds": 2})
    assert main(["train", "mpe/simple_spread_qmix", "num_seeds=2"]) == 2

    def run(seed: int, where: str, **extra) -> Path:
        over = {**SMALL, "seed": seed, "total_env_steps": 64, "run_dir": str(tmp_path / where)}
        return train("mpe/simple_spread_jaxmarl_ff", {**over, **extra}).dir

    a, b = run(1, "a"), run(2, "b", **{"algo.epochs": 2})
    with pytest.raises(ConfigError, match="algo.epochs"):
        resume_seeds([a, b], {"total_env_steps": 128})
    c = run(3, "c", total_env_steps=128)
    with pytest.raises(ConfigError, match="different iterations"):
        resume_seeds([a, c], {"total_env_steps": 256})
    with pytest.raises(ConfigError, match="twice"):
        resume_seeds([a, a], {"total_env_steps": 128})
    d = run(1, "d")
    with pytest.raises(ConfigError, match="same seed"):
        resume_seeds([a, d], {"total_env_steps": 128})
    # nothing was written into the runs by the refusals
    assert (a / "metrics.csv").read_text().count("\n") == 2


@pytest.mark.parametrize(
    ("preset", "blocks"),
    [
        # feed-forward, a long run: eight env steps per graph with the stacked policy step
        ("mpe/simple_spread_jaxmarl_ff", True),
        # recurrent: one env step per graph with the stacked policy step (chunks of 3: every
        # unrolled step of the compiled loss adds to the cold compile)
        ("mpe/simple_spread", False),
    ],
)
def test_compiled_stacked_updates_equal_eager(preset, blocks):
    cfg = _cfg(preset, **({} if blocks else {"algo.data_chunk_length": 3}))
    out = []
    for setting in ("off", "on"):
        cfgs = [dataclasses.replace(cfg, seed=s, compile=setting) for s in (1, 2)]
        stacked = StackedPPOLearner(cfgs, make_seed_envs(cfgs, torch.device(DEVICE)))
        if setting == "on":
            # The particle world's step is traced with the stacked policy step where the
            # device's rule says so (the CPU always; CUDA for feed-forward networks).
            fused = fuses_env_step(torch.device(DEVICE), recurrent=not blocks)
            assert (stacked.collector.fused_fn is not None) == fused
            assert (stacked.collector.block_fn is not None) == (blocks and fused)
        for it in range(2):
            stacked.iterate(it, 0)
        out.append([p.state_dict() for p in stacked.policies])
    for eager, compiled in zip(*out, strict=True):
        assert _max_diff(eager, compiled) < PARAM_TOL


def test_a_signal_stops_every_seed_with_a_checkpoint_and_one_command_resumes_them(tmp_path):
    args = [
        "mpe/simple_spread_jaxmarl_ff", "num_seeds=2", "env.num_envs=4", "rollout_length=16",
        "eval_episodes=2", "threads=1", "checkpoint_interval=1000", "total_env_steps=10000000",
        "progress=false", "tensorboard=false", "log_interval=1", "run_dir=runs",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "mappo.cli", "train", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("runs/*/*/*/*/metrics.csv"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    note, line = err.strip().splitlines()  # the signal acknowledged, then the command
    assert (
        note
        == "mappo: stopping after this iteration, with a checkpoint (a second signal stops at once)"
    )
    runs = sorted(tmp_path.glob("runs/mpe/simple_spread_jaxmarl_ff/ippo/*"))
    assert len(runs) == 2
    command = line.split("continue with: ")[1]
    assert command.split()[:3] == ["mappo", "train", "--resume"]
    assert sorted(command.split()[3:]) == sorted(str(r.relative_to(tmp_path)) for r in runs)
    steps = []
    for r in runs:
        (ckpt,) = sorted((r / "checkpoints").glob("*.pt"))
        steps.append(torch.load(ckpt, weights_only=True)["progress"]["env_steps"])
    assert steps[0] == steps[1] > 0
    end = steps[0] + 128
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mappo.cli",
            "train",
            "--resume",
            *command.split()[3:],
            f"total_env_steps={end}",
        ],  # fmt: skip
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("result:") == 2 and "trained together" in resumed.stdout


@pytest.mark.parametrize("bad", [[1], [1, 2]])
def test_one_diverging_seed_stops_all_before_any_saves_that_iteration(tmp_path, monkeypatch, bad):
    from mappo.trainer import TrainingDiverged

    original = StackedPPOLearner.iterate
    calls = []

    def iterate(self, iteration, env_steps):
        results = original(self, iteration, env_steps)
        calls.append(iteration)
        if len(calls) == 2:
            for k in bad:
                results[k]["agents/policy_loss"] = float("nan")
        return results

    monkeypatch.setattr(StackedPPOLearner, "iterate", iterate)
    cfg = _cfg("mpe/simple_spread_jaxmarl_ff")
    over = {**SMALL, "num_seeds": 3, "checkpoint_interval": 1, "eval_episodes": 2,
            "total_env_steps": _steps(cfg, 4), "run_dir": str(tmp_path)}  # fmt: skip
    with pytest.raises(TrainingDiverged, match="^seed 2: training diverged in update 2") as err:
        train_seeds("mpe/simple_spread_jaxmarl_ff", over)
    runs = sorted(tmp_path.glob("*/*/*/*"))
    # only the healthy seeds are named, with the command that continues them (a seed that
    # diverged in the same update would diverge again)
    healthy = [r for r in runs if int(r.name.rsplit("_seed", 1)[1]) - 1 not in bad]
    command = "mappo train --resume " + " ".join(map(str, healthy))
    assert str(err.value).endswith(f"continue them with `{command}`")
    assert ("(seeds 3 diverged in this update too)" in str(err.value)) == (len(bad) == 2)
    assert len(runs) == 3
    for run in runs:  # every seed keeps its iteration-1 checkpoint, and nothing after it
        assert [p.name for p in sorted((run / "checkpoints").glob("*.pt"))] == ["iter_00000001.pt"]


def test_seeds_of_an_env_in_worker_processes_match_and_resume(tmp_path):
    """PettingZoo's Spread through the adapter: envs stepped one seed after another, and an env
    that cannot be snapshotted, which starts fresh episodes on resume as a single run does."""
    preset = "pettingzoo/simple_spread"
    base = {**SMALL, "env.num_envs": 2, "rollout_length": 25, "eval_episodes": 2,
            "checkpoint_interval": 1, "algo.lr_decay": False}  # fmt: skip
    cfg = _cfg(preset, **base)
    one, two = _steps(cfg, 1), _steps(cfg, 2)
    first = train_seeds(
        preset, {**base, "num_seeds": 2, "total_env_steps": one, "run_dir": str(tmp_path / "a")}
    )
    singles = [
        train(preset, {**base, "seed": s, "total_env_steps": one, "run_dir": str(tmp_path / "s")})
        for s in (1, 2)
    ]
    for run, single in zip(first, singles, strict=True):
        assert _max_diff(run.policy.state_dict(), single.policy.state_dict()) < PARAM_TOL
    alone = tmp_path / "alone"
    shutil.copytree(first[0].dir, alone)
    together = resume_seeds([r.dir for r in first], {"total_env_steps": two})
    single = resume(alone, {"total_env_steps": two})
    assert _max_diff(together[0].policy.state_dict(), single.policy.state_dict()) < PARAM_TOL


def test_a_seed_whose_folder_cannot_be_made_leaves_no_folders_and_resume_takes_no_num_seeds(
    tmp_path, monkeypatch
):
    """A file in the way of seed 2's run directory: the error comes before anything is written
    (seed 1's folder, made first, was left behind empty). Resuming seeds together refuses
    num_seeds as resuming one run does (it was ignored)."""
    monkeypatch.setattr(time, "strftime", lambda *_: "20260101-000000")
    base = tmp_path / "mpe" / "simple_spread_fast" / "rmappo"
    base.mkdir(parents=True)
    (base / "20260101-000000_seed2").write_text("in the way")
    cfg = _cfg("mpe/simple_spread_fast", run_dir=str(tmp_path), total_env_steps=128)
    with pytest.raises(ConfigError, match="a file of that name is in the way; move that file"):
        train_seeds(dataclasses.replace(cfg, num_seeds=2))
    assert sorted(p.name for p in base.iterdir()) == ["20260101-000000_seed2"]
    (base / "20260101-000000_seed2").unlink()
    runs = train_seeds(dataclasses.replace(cfg, num_seeds=2))
    with pytest.raises(ConfigError, match="num_seeds cannot be set when resuming; the run"):
        resume_seeds([r.dir for r in runs], {"num_seeds": 3, "total_env_steps": 256})
