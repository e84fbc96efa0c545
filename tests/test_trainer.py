"""The trainer end to end: every variant on every particle scenario, learning, exact resume."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mappo
from mappo import config as C
from mappo.algos.mappo import make_samples
from mappo.cli import main
from mappo.trainer import Trainer, latest_checkpoint, load_checkpoint, resume, train

sys.path.insert(0, str(Path(__file__).parent))
from toy_env import register_toy  # noqa: E402

register_toy()

TINY = {
    "env.num_envs": 8,
    "rollout_length": 25,
    "total_env_steps": 8 * 25 * 3,
    "algo.epochs": 2,
    "eval_episodes": 4,
    "eval_interval": 2,
    "log_interval": 1,
    "progress": False,
}

SCENARIOS = ["mpe/simple_spread", "mpe/simple_speaker_listener", "mpe/simple_reference"]
VARIANTS = ["", "_mappo", "_ippo"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_on_every_scenario_writes_its_run_dir(tmp_path, scenario, variant):
    run = train(scenario + variant, {**TINY, "run_dir": str(tmp_path)})
    d = run.dir
    algo = {"": "rmappo", "_mappo": "mappo", "_ippo": "rippo"}[variant]
    assert d.parent == tmp_path / (scenario + variant) / algo  # named after the preset
    assert d.name.endswith("_seed1")
    assert C.load(str(d / "config.yaml")).env.name == scenario
    rows = list(csv.DictReader((d / "metrics.csv").open()))
    assert len(rows) == 3 and rows[-1]["env_steps"] == str(8 * 25 * 3)
    assert any(f.name.startswith("events") for f in (d / "tensorboard").iterdir())
    summary = json.loads((d / "summary.json").read_text())
    for key in ("eval_return_mean", "env_steps", "wall_seconds", "steps_per_second"):
        assert key in summary
    assert summary["preset"] == scenario + variant and summary["task"] == scenario
    assert summary["env_steps"] == 600
    assert latest_checkpoint(d).name == "iter_00000003.pt"
    # Losses and diagnostics are logged for each group.
    group = next(iter(run.policy.actors))
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction"):
        assert f"loss/{group}/{k}" in rows[-1]


def test_a_folder_that_holds_a_run_is_not_trained_into_again(tmp_path):
    """``run_dir=`` names the run's own folder: a second run into it replaced the first one's
    config and metrics and left its later checkpoints beside its own (a resume then took them).
    The summary file holds the folder's absolute path."""
    first = train("mpe/simple_spread_fast", {**TINY, "seed": 1}, run_dir=tmp_path / "run")
    saved = {f: (first.dir / f).read_bytes() for f in ("config.yaml", "metrics.csv")}
    with pytest.raises(C.ConfigError, match="already holds a run; continue it with mappo.resume"):
        train("mpe/simple_spread_fast", {**TINY, "seed": 2}, run_dir=tmp_path / "run")
    assert {f: (first.dir / f).read_bytes() for f in saved} == saved
    summary = json.loads((first.dir / "summary.json").read_text())
    assert summary["run_dir"] == str((tmp_path / "run").absolute())


def _collected(overrides: dict) -> Trainer:
    cfg = C.load(None, {**TINY, **overrides})
    trainer = Trainer(cfg)
    trainer.collector.collect()
    return trainer


@pytest.mark.parametrize(
    ("recurrent", "chunk"), [("gru", 5), ("gru", 10), ("lstm", 13), ("none", None)]
)
def test_chunked_training_forward_reproduces_the_rollout(recurrent, chunk):
    """The first forward pass of an update, on chunks starting from stored recurrent states (also
    across env boundaries and episodes that end mid-chunk), gives the rollout's own log-probs and
    values."""
    trainer = _collected(
        {
            "env.name": "toy/match",
            "env.kwargs": {"terminate_early": True, "masks": True, "deaths": True},
            "rollout_length": 13,
            **({} if chunk is None else {"algo.data_chunk_length": chunk}),
            "model.recurrent": recurrent,
            "algo.critic_input": "local",
        }
    )
    policy, cfg = trainer.policy, trainer.cfg
    samples = make_samples(policy, trainer.collector.rollout, cfg.algo, recurrent != "none")
    s = samples.groups["agents"]
    dist, _ = policy.actors["agents"](
        s.obs, s.actor_state, samples.starts, s.action_mask, s.actor_inject
    )
    valid = samples.valid.bool()
    torch.testing.assert_close(
        dist.log_prob(s.actions)[valid], s.log_probs[valid], atol=1e-5, rtol=1e-5
    )
    values, _ = policy.critics["agents"](
        s.critic_x, s.critic_state, samples.starts, s.critic_inject
    )
    torch.testing.assert_close(values[valid], s.values[valid], atol=1e-5, rtol=1e-5)


def test_masks_and_deaths_reach_the_loss():
    trainer = _collected(
        {
            "env.name": "toy/match",
            "env.kwargs": {"masks": True, "deaths": True, "two_heads": True},
            "rollout_length": 6,
        }
    )
    buf = trainer.collector.rollout.groups["agents"]
    # The last agent dies after step 2: it is inactive from then on and only took action 0.
    alive = buf.alive[:, :, -1]
    assert alive[:2].all() and not alive[2:].any()
    assert torch.all(buf.actions[2:, :, -1, 0] == 0)
    # The always-masked action is never sampled.
    assert not torch.any(buf.actions[..., 0] == 3)


def test_short_spread_run_improves_its_return(tmp_path):
    run = train(
        "mpe/simple_spread_mappo",
        {
            "env.num_envs": 64,
            "total_env_steps": 64 * 25 * 40,
            "algo.epochs": 5,
            "actor_lr": 2e-3,
            "critic_lr": 2e-3,
            "log_interval": 1,
            "eval_interval": 40,
            "progress": False,
            "run_dir": str(tmp_path),
            "tensorboard": False,
        },
    )
    rows = list(csv.DictReader((run.dir / "metrics.csv").open()))
    returns = [float(r["train/episode_return"]) for r in rows]
    first, last = sum(returns[:3]) / 3, sum(returns[-3:]) / 3
    assert last > first + 15, (first, last)


def test_learns_the_toy_task_with_every_option(tmp_path):
    run = train(
        C.load(
            None,
            {
                **TINY,
                "env.name": "toy/match",
                "total_env_steps": 8 * 25 * 40,
                "env.kwargs": {"masks": True, "deaths": True, "two_heads": True},
                "algo.critic_input": "agent_state",
                "algo.death_masked_critic": True,
                "algo.value_norm": "popart",
                "algo.bootstrap_truncation": True,
                "algo.returns": "td_lambda",
                "algo.lr_decay": True,
                "algo.num_minibatches": 2,
                "model.share_params": False,
                "model.recurrent": "lstm",
                "model.agent_id": True,
                "run_dir": str(tmp_path),
                "eval_interval": 40,
                "algo.epochs": 4,
            },
        )
    )
    # Episodes of 6 steps; the second agent is alive for the first 2: a perfect policy scores
    # 6 + 2 = 8 per agent, a uniformly random one (3 allowed actions) 8 / 3.
    assert run.summary["eval_return_mean"] >= 7.0


def _params(policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


RESUME = {
    **TINY,
    "total_env_steps": 8 * 25 * 6,
    "checkpoint_interval": 2,
    "algo.epochs": 3,
    "algo.num_minibatches": 2,
    "eval_interval": 3,
    "algo.lr_decay": True,
    # Bit-exact resumption holds at a fixed thread count (a reduction split over another number
    # of threads may round differently); the resumed CLI runs use one thread too.
    "threads": 1,
}


def test_resume_equals_uninterrupted(tmp_path):
    full = train("mpe/simple_spread", {**RESUME, "run_dir": str(tmp_path / "a")})
    part = train("mpe/simple_spread", {**RESUME, "run_dir": str(tmp_path / "b")})
    # Simulate a run stopped after its second checkpoint (iteration 4): drop the later one.
    ckpts = sorted((part.dir / "checkpoints").glob("iter_*.pt"))
    for p in ckpts:
        if p.name > "iter_00000004.pt":
            p.unlink()
    # the progress line's training return comes back with the counters (it showed n/a)
    kept = load_checkpoint(part.dir / "checkpoints" / "iter_00000004.pt")["progress"]
    assert math.isfinite(kept["last_train"]["episode_return"])
    resumed = resume(part.dir)
    a, b = _params(full.policy), _params(resumed.policy)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert resumed.summary["env_steps"] == full.summary["env_steps"]
    assert resumed.summary["eval_return_mean"] == full.summary["eval_return_mean"]
    rows_a = list(csv.DictReader((full.dir / "metrics.csv").open()))
    rows_b = list(csv.DictReader((resumed.dir / "metrics.csv").open()))
    assert [r["env_steps"] for r in rows_a] == [r["env_steps"] for r in rows_b]
    assert [r["train/episode_return"] for r in rows_a] == [
        r["train/episode_return"] for r in rows_b
    ]
    # The time columns are totals over the whole run, across the resume too (the rollout's
    # and the update's seconds restarted from 0 while wall_seconds went on).
    for column in ("wall_seconds", "time/rollout_seconds", "time/update_seconds"):
        totals = [float(r[column]) for r in rows_b]
        assert totals == sorted(totals) and totals[0] > 0, column


def test_a_run_stopped_by_its_time_limit_ends_like_a_finished_one_and_resumes_exactly(
    tmp_path, capsys
):
    """max_wall_seconds ends the run after the iteration that passes it, with a final
    evaluation, checkpoint and summary; the resume continues to the same parameters, and its
    later evaluations draw the uninterrupted run's seeds (the stop's own is not counted)."""
    full = train("mpe/simple_spread", {**RESUME, "run_dir": str(tmp_path / "a")})
    cut = train(
        "mpe/simple_spread", {**RESUME, "run_dir": str(tmp_path / "b"), "max_wall_seconds": 1e-6}
    )
    assert cut.summary["env_steps"] == 200 and cut.summary["stopped_at_max_wall_seconds"] == 1e-6
    assert math.isfinite(cut.summary["eval_return_mean"])  # the stop's evaluation
    assert [p.name for p in (cut.dir / "checkpoints").iterdir()] == ["iter_00000001.pt"]
    resumed = resume(cut.dir, {"max_wall_seconds": 0})
    a, b = _params(full.policy), _params(resumed.policy)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert resumed.summary["eval_return_mean"] == full.summary["eval_return_mean"]
    assert "stopped_at_max_wall_seconds" not in resumed.summary
    rows = list(csv.DictReader((resumed.dir / "metrics.csv").open()))
    evaluated = [int(r["env_steps"]) for r in rows if r.get("eval/eval_return_mean")]
    assert evaluated == [200, 600, 1200]  # the stop's, then the uninterrupted run's two
    # from the command line: the note says how to continue, and the resume gets there
    d = tmp_path / "c"
    over = [f"{k}={v}" for k, v in RESUME.items()] + [f"run_dir={d}", "max_wall_seconds=1e-6"]
    assert main(["train", "mpe/simple_spread", *over]) == 0
    (run_dir,) = d.glob("*/*/*/*")
    err = capsys.readouterr().err
    assert "stopped at max_wall_seconds=1e-06 after 200 of 1,200 env steps; continue with " in err
    assert f"`mappo train --resume {run_dir}`" in err
    assert main(["train", "--resume", str(run_dir), "max_wall_seconds=0"]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["env_steps"] == 1200


def test_a_new_budget_on_resume_with_a_decaying_learning_rate_warns(tmp_path):
    over = {**TINY, "algo.lr_decay": True, "run_dir": str(tmp_path)}
    run = train("mpe/simple_spread_ff_fast", over)
    more = {"total_env_steps": 2 * TINY["total_env_steps"]}
    with pytest.warns(UserWarning, match="continue from 50% of their start where the run had"):
        resume(run.dir, more)


def _as_if_from_a_gpu(state):
    """``state`` with every CPU generator state (the Mersenne Twister's 5,056 bytes) in place of
    a CUDA generator's (16 bytes: seed and offset), as a run trained on a GPU saves them."""
    if isinstance(state, dict):
        return {k: _as_if_from_a_gpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_as_if_from_a_gpu(v) for v in state]
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.numel() == 5056:
        return torch.arange(16, dtype=torch.uint8)
    return state


@pytest.mark.parametrize(
    ("preset", "over"),
    [
        ("mpe/simple_spread", {}),  # the env's generator and the actions' and batches' ones
        ("mpe/simple_spread_qmix", {}),
        ("mpe/simple_spread_coma", {}),
        ("mpe/simple_spread_maddpg", {}),  # three generators, one of them the Gumbel noise's
        ("mpe/simple_spread_ff_fast", {"num_seeds": 2}),  # stacked seeds: one env, blocks
    ],
)
def test_a_run_trained_on_a_gpu_resumes_on_a_cpu(tmp_path, preset, over):
    # A CUDA generator's state cannot be loaded into a CPU generator (nor back); the resumed
    # run seeds its generators afresh and says that it does not replay the first device.
    tiny = {k: v for k, v in TINY.items() if not k.startswith(("algo.", "rollout"))}
    over = {**tiny, "threads": 1, **over, "run_dir": str(tmp_path)}
    if over.get("num_seeds"):
        dirs = [run.dir for run in mappo.trainer.train_seeds(C.load(preset, over))]
    else:
        dirs = [train(preset, over).dir]
    for d in dirs:
        newest = latest_checkpoint(d)
        mappo.checkpoint.atomic_save(_as_if_from_a_gpu(load_checkpoint(newest)), newest)
    more = {"total_env_steps": 2 * TINY["total_env_steps"]}
    with pytest.warns(mappo.checkpoint.CheckpointWarning, match="another kind of device"):
        if len(dirs) > 1:
            runs = mappo.trainer.resume_seeds(dirs, more)
        else:
            runs = [resume(dirs[0], more)]
    for run in runs:
        assert run.summary["env_steps"] >= more["total_env_steps"]


@pytest.mark.parametrize(
    ("preset", "key", "column"),
    [
        ("mpe/simple_spread_ff_fast", "algo.actor_lr", "actor_lr"),
        ("mpe/simple_spread_ff_fast", "algo.critic_lr", "critic_lr"),
        ("mpe/simple_spread_qmix", "algo.lr", "lr"),
        ("mpe/simple_spread_coma", "algo.critic_lr", "critic_lr"),
        ("mpe/simple_spread_maddpg", "algo.actor_lr", "actor_lr"),
    ],
)
def test_a_learning_rate_changed_on_resume_is_the_one_trained_with(tmp_path, preset, key, column):
    # The optimiser's saved state carries its settings; loading it had put the old rate back
    # while config.yaml named the new one (so lowering the rates after a divergence did nothing).
    cfg = {"env.num_envs": 4, "total_env_steps": 200, "threads": 1, "progress": False}
    cfg.update({"log_interval": 1, "eval_interval": 100, "eval_episodes": 2})
    if preset.endswith("ff_fast"):
        cfg.update({"rollout_length": 25, "algo.lr_decay": False})
    run = train(preset, {**cfg, "run_dir": str(tmp_path)})
    before = float(list(csv.DictReader((run.dir / "metrics.csv").open()))[-1][column])
    resumed = resume(run.dir, {"total_env_steps": 400, key: before / 10})
    rows = list(csv.DictReader((resumed.dir / "metrics.csv").open()))
    assert float(rows[0][column]) == before
    assert float(rows[-1][column]) == pytest.approx(before / 10)


@pytest.mark.parametrize("recurrent", ["none", "gru"])
def test_an_epoch_takes_exactly_num_minibatches_gradient_steps(recurrent):
    # 100 samples (10 chunks of 10 steps) in 51 (6) mini-batches: torch.chunk gave 50 (5).
    n = 51 if recurrent == "none" else 6
    cfg = C.load(
        "mpe/simple_spread",
        {"env.num_envs": 4, "rollout_length": 25, "model.recurrent": recurrent, "threads": 1,
         "algo.epochs": 1, "algo.num_minibatches": n},  # (the preset's chunks: 10 steps)
    )  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.learner.iterate(1, 100)
        steps = {float(s["step"]) for s in trainer.learner.optim.actor.state.values()}
        assert steps == {n}
    finally:
        trainer.close()


def test_killed_run_resumes_to_the_same_parameters(tmp_path):
    """kill -9 at an arbitrary moment after the first checkpoint, then resume from the CLI."""
    overrides = [
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
        for k, v in {**RESUME, "total_env_steps": 8 * 25 * 8}.items()
    ]
    ref = train(
        "mpe/simple_spread", C.parse_overrides(overrides) | {"run_dir": str(tmp_path / "a")}
    )
    run_dir = tmp_path / "b"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "mappo.cli",
        "train",
        "mpe/simple_spread",
        *overrides,
        f"run_dir={run_dir}",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(run_dir.rglob("iter_00000002.pt")):
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (d,) = [p.parent.parent for p in run_dir.rglob("checkpoints/iter_*.pt")][:1]
    done = subprocess.run(
        [sys.executable, "-m", "mappo.cli", "train", "--resume", str(d)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    final = load_checkpoint(latest_checkpoint(d))
    assert final["progress"]["iteration"] == 8
    for k, v in _params(ref.policy).items():
        torch.testing.assert_close(final["learner"]["policy"][k], v, rtol=0, atol=0)


def test_load_policy_acts_outside_training(tmp_path):
    run = train("mpe/simple_reference", {**TINY, "run_dir": str(tmp_path)})
    policy = mappo.load_policy(run.dir)
    env = mappo.envs.make("mpe/simple_reference", num_envs=3, seed=0)
    step = env.reset()
    actions = policy.act(step.obs)
    assert actions["agents"].shape == (3, 2, 2)
    step = env.step(actions)
    actions = policy.act(step)  # an EnvStep works too, carrying episode starts
    assert policy.act(step.obs, starts=False)["agents"].shape == (3, 2, 2)  # one flag for all
    with pytest.warns(UserWarning, match="recurrent state was kept for 3 envs and is started"):
        single = policy.act({"agents": step.obs["agents"][0].numpy()})
    assert single["agents"].shape == (2, 2)
    with pytest.raises(ValueError, match="group 'agents' have shape"):
        policy.act({"agents": torch.zeros(3, 2, 7)})
    obs = step.obs["agents"]
    for call, error, message in [
        (lambda: policy.act(obs), TypeError, "observations must be a dict of arrays"),
        (lambda: policy.act(None), TypeError, "observations must be a dict"),
        (lambda: policy.act({"agents": obs * float("nan")}), ValueError, "hold NaN or inf"),
        (lambda: policy.act(step.obs, {"agnts": torch.ones(3, 2, 1)}), ValueError, "'agnts'"),
        (lambda: policy.act(step.obs, starts=[True, False]), ValueError, "one flag per env"),
        (lambda: policy.act(step.obs, deterministic="no"), TypeError, "True or False"),
        (lambda: policy.act(step.obs, generator=5), TypeError, "torch.Generator"),
        (lambda: policy.act({"agents": "obs"}), TypeError, "'agents'\\] must be an array"),
        (lambda: policy.act({"agents": [[1], [2, 3]]}), TypeError, "must be an array of"),
        (lambda: policy.act(step.obs, starts="yes"), TypeError, "starts must be an array"),
        (lambda: policy.act(step.obs, torch.ones(3, 2, 15)), TypeError, "action_mask must be"),
        # a mask of the right size in the wrong layout ([agents, envs, ...] reshaped would
        # have given one agent's allowed actions to another)
        (lambda: policy.act(step.obs, {"agents": torch.ones(2, 3, 15)}), ValueError, "\\(2, 3,"),
    ]:
        with pytest.raises(error, match=message):
            call()
    # A mask that forbids a whole head for an agent (the policy would act against it).
    mask = torch.ones(3, 2, 15, dtype=torch.bool)
    mask[2, 1, 5:] = False
    for call, message in [
        (lambda: policy.act(step.obs, {"agents": mask}), "for agent 1 of env 2 in action head 1"),
        (lambda: policy.act({"agents": obs[2]}, {"agents": mask[2]}), "for agent 1 in action"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    # Greedy actions match the trained model's mode.
    dist, _ = run.policy.actors["agents"](
        step.obs["agents"].unsqueeze(0),
        torch.zeros(3, 2, run.policy.actors["agents"].state_size),
        torch.ones(1, 3, dtype=torch.bool),
        None,
    )
    policy.reset()
    torch.testing.assert_close(policy.act(step.obs)["agents"], dist.mode()[0])


def test_a_config_built_in_code_is_checked_field_by_field(tmp_path):
    """A TrainConfig edited in code meets each field's range as an override does (a negative
    budget trained nothing and returned a run)."""
    cfg = mappo.load_config("mpe/simple_spread")
    cfg.total_env_steps = -5
    with pytest.raises(C.ConfigError, match="'total_env_steps' must be >= 1, got -5"):
        train(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_recurrent_policy_starts_afresh_at_a_reset(tmp_path):
    """The step of ``env.reset()`` starts every env's episode: the recurrent state of the
    episodes played before does not carry on (the same greedy episode played twice gave two
    returns). ``Run.load_policy`` gives the policy to act with; ``train`` gives the caller's
    torch thread count back."""
    threads = torch.get_num_threads()
    run = train("mpe/simple_spread", {**TINY, "run_dir": str(tmp_path), "threads": threads + 1})
    assert torch.get_num_threads() == threads
    policy = run.load_policy()
    assert isinstance(policy, mappo.Policy)
    env = mappo.envs.make("mpe/simple_spread", num_envs=3, seed=0)

    def episode() -> list[torch.Tensor]:
        step, played = env.reset(seed=7), []
        for _ in range(6):
            actions = policy.act(step)
            played.append(actions["agents"])
            step = env.step(actions)
        return played

    first, second = episode(), episode()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    env.close()


def test_policy_act_excuses_dead_agents_masks_in_an_env_step(tmp_path):
    """A dead agent's mask may allow nothing (the env ignores its action): an EnvStep's alive
    flags excuse it, a bare mask of the same values is refused."""
    import dataclasses

    overrides = {**TINY, "env.name": "toy/match", "run_dir": str(tmp_path)}
    run = train(C.load(None, {**overrides, "env.kwargs": {"masks": True, "deaths": True}}))
    policy = mappo.load_policy(run.dir)
    env = mappo.envs.make("toy/match", num_envs=2, seed=0, masks=True, deaths=True)
    step = env.reset()
    for _ in range(3):
        step = env.step(policy.act(step))
    alive = step.alive["agents"]
    assert not alive[:, -1].any()  # the last agent died after step 2
    mask = step.action_mask["agents"].clone()
    mask[:, -1] = False
    step = dataclasses.replace(step, action_mask={"agents": mask})
    assert policy.act(step)["agents"].shape == (2, 2, 1)
    sampled = policy.act(step, deterministic=False)["agents"]  # a dead agent's head is opened
    assert ((sampled >= 0) & (sampled < 4)).all()
    with pytest.raises(ValueError, match="allows no action for agent 1 of env 0; every acting"):
        policy.act(step.obs, {"agents": mask})
    # Without its masks a masked group's policy would return forbidden actions.
    with pytest.raises(ValueError, match="group .agents. acts under action masks \\(its env"):
        policy.act(step.obs)


def test_an_env_whose_agents_are_never_alive_is_named(tmp_path):
    """Every loss skips agents that are not alive: an env that never sets ``alive`` would train
    nothing while looking healthy, so the first rollout of the run warns, once."""
    import dataclasses
    import warnings

    from toy_env import MatchEnv

    from mappo.envs.registry import register

    class NobodyAlive(MatchEnv):
        name = "toy/nobody_alive"

        def _alive(self) -> torch.Tensor:
            return torch.zeros(self.num_envs, self.n, dtype=torch.bool, device=self.device)

        def _step(self, actions):
            step = super()._step(actions)  # its accuracy divides by the (no) living agents
            step.stats = {k: v.nan_to_num() for k, v in step.stats.items()}
            return step

    register("toy/nobody_alive", NobodyAlive)
    seen = {}
    for env_name in ("toy/nobody_alive", "toy/match"):
        cfg = C.load(None, {**TINY, "env.name": env_name, "run_dir": str(tmp_path / env_name)})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(cfg)
        seen[env_name] = [str(w.message) for w in caught if "was alive" in str(w.message)]
    assert seen == {
        "toy/nobody_alive": [
            "no agent of group 'agents' was alive in any of the first rollout's 25 steps in 8 "
            "envs, so the losses, which skip agents that are not alive, leave its policy and "
            "critic untrained; the env should return alive=True for the agents that act"
        ],
        "toy/match": [],
    }
    # Stacked seeds share one rollout: one warning, from the first seed.
    cfg = C.load(None, {**TINY, "env.name": "toy/nobody_alive", "num_seeds": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mappo.train_seeds(dataclasses.replace(cfg, run_dir=str(tmp_path / "stacked")))
    stacked = [str(w.message) for w in caught if "was alive" in str(w.message)]
    assert len(stacked) == 1 and "group 'agents'" in stacked[0], stacked


def test_a_late_mask_that_allows_nothing_for_a_living_agent_is_named(tmp_path):
    """Only a user's env's first outputs are checked as they come: an alive agent whose mask
    allows nothing later on had a forbidden action sampled, taken and trained on, silently.
    The rollout's masks are checked once it is collected, an evaluation's as it goes."""
    from toy_env import MatchEnv

    from mappo.envs import EnvError
    from mappo.envs.base import OUTPUT_CHECKS
    from mappo.envs.registry import register

    class ClosesLate(MatchEnv):
        def _step(self, actions):
            step = super()._step(actions)
            self.steps = getattr(self, "steps", 0) + 1
            if self.steps == OUTPUT_CHECKS + 5:
                mask = step.action_mask["agents"].clone()
                mask[3, 1] = False
                step.action_mask = {"agents": mask}
            return step

    register("toy/closes_late", ClosesLate)
    overrides = {**TINY, "env.name": "toy/closes_late", "env.kwargs": {"masks": True}}
    cfg = C.load(None, {**overrides, "run_dir": str(tmp_path / "mappo")})
    message = (
        "toy/match: action_mask\\['agents'\\] allows no action for alive agent 1 of env 3 at "
        f"step {OUTPUT_CHECKS + 5} of a rollout; allow at least one"
    )
    with pytest.raises(EnvError, match=message):
        train(cfg)
    # the episodes of the value family: the same check (the reset is the episode's step 0)
    overrides = {k: v for k, v in overrides.items() if k not in ("algo.epochs", "rollout_length")}
    overrides.update({"algo.name": "vdn", "run_dir": str(tmp_path / "vdn")})
    with pytest.raises(EnvError, match="agent 1 of env 3 at step [0-9]+ of an episode; allow"):
        train(C.load(None, overrides))
    # an evaluation (greedy: the argmax of nothing) after the env's checked outputs
    from mappo.evaluation import evaluate

    policy = Trainer(cfg).policy
    env = ClosesLate(num_envs=4, masks=True)
    step = env.reset(seed=0)
    for _ in range(OUTPUT_CHECKS + 2):
        step = env.step({"agents": step.action_mask["agents"].int().argmax(-1, keepdim=True)})
    with pytest.raises(EnvError, match="agent 1 of env 3 at step 3 of an evaluation; allow"):
        evaluate(policy, env, seed=0)


def test_checkpoint_loads_without_running_code(tmp_path):
    evil = tmp_path / "evil.pt"
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    evil.write_bytes(pickle.dumps({"format": 1, "x": Boom()}))
    with pytest.raises(mappo.trainer.CheckpointError, match="not a readable mappo checkpoint"):
        load_checkpoint(evil)
    assert not (tmp_path / "pwned").exists()


def test_train_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    train("mpe/simple_spread", {**TINY, "run_dir": str(tmp_path), "total_env_steps": 200})
    assert torch.equal(before, torch.get_rng_state())


def test_a_format_1_checkpoint_still_resumes(tmp_path):
    """Checkpoints written before the learner layout (format 1: a MAPPO run's fields side by
    side) are converted on load, so runs started with an older version can be resumed."""
    run = train("mpe/simple_spread", {**TINY, "run_dir": str(tmp_path), "threads": 1})
    path = latest_checkpoint(run.dir)
    new = load_checkpoint(path)
    learner, collector = new["learner"], new["learner"]["collector"]
    old = {
        "format": 1,
        "config": new["config"],
        "spec": new["spec"],
        **new["progress"],
        "policy": learner["policy"],
        "optim_actor": learner["optim"]["actor"],
        "optim_critic": learner["optim"]["critic"],
        "rng": {**learner["rng"], "env": collector["env"]["rng"]},
        "env_state": collector["env"]["state"],
        **{k: collector[k] for k in ("step", "actor_states", "critic_states", "starts")},
        "tracker": collector["tracker"],
    }
    torch.save(old, path)
    converted = load_checkpoint(path)
    assert converted["format"] == 2
    kept = {k: v for k, v in new["progress"].items() if k not in ("timings", "last_train")}
    assert converted["progress"] == kept
    resumed = resume(run.dir, {"total_env_steps": 8 * 25 * 4})
    assert resumed.summary["env_steps"] == 800


@pytest.mark.parametrize(
    ("overrides", "rows_taken"),
    [
        # dead agents leave the losses: a local critic per agent, agent ids, two action heads
        (
            {
                "env.name": "toy/match",
                "env.kwargs": {"masks": True, "deaths": True, "two_heads": True},
                "rollout_length": 7,
                "algo.critic_input": "local",
                "model.agent_id": True,
                "algo.clip_value_loss": True,
            },
            True,
        ),
        # turn-based: one player of two in the losses; the critic is one per game (broadcast)
        (
            {
                "env.name": "hanabi/small-2p",
                "rollout_length": 9,
                "algo.value_norm": "popart",
                "model.hidden_sizes": [32],
            },
            True,
        ),
        # the same with one critic per player (independent critics)
        ({"env.name": "hanabi/small-2p", "rollout_length": 9, "algo.critic_input": "local"}, True),
        # continuous and discrete groups, a death-masked critic of the state (per agent)
        (
            {
                "env.name": "toy/reach",
                "env.kwargs": {"mixed": True},
                "rollout_length": 6,
                "algo.death_masked_critic": True,
                "model.state_dependent_std": True,
            },
            True,
        ),
        # parameters per agent, or a recurrent network: every row, masked
        ({"env.name": "hanabi/small-2p", "rollout_length": 9, "model.share_params": False}, False),
        (
            {"env.name": "hanabi/small-2p", "rollout_length": 9, "model.recurrent": "gru"},
            False,
        ),
    ],
)
def test_losses_over_the_active_rows_equal_the_masked_losses(overrides, rows_taken, monkeypatch):
    """A feed-forward network with shared parameters is evaluated only on the rows its
    active-masked losses use; the loss terms (clipping and diagnostics included: the parameters
    are moved off the rollout's) and the gradients equal those of the masked losses over every
    row, up to the order of the sums. Other networks take every row."""
    from mappo.algos import mappo as algo
    from mappo.nn.actor_critic import Actor, Critic

    overrides = {"model.recurrent": "none", **overrides}
    trainer = _collected(overrides)
    policy, cfg = trainer.policy, trainer.cfg
    recurrent = cfg.model.recurrent != "none"
    samples = make_samples(policy, trainer.collector.rollout, cfg.algo, recurrent)
    gen = torch.Generator().manual_seed(0)
    for s in samples.groups.values():
        if float(s.alive.mean()) > algo.LOSS_ROWS_MAX_SHARE:  # nobody dies here: kill some
            s.alive.mul_((torch.rand(s.alive.shape, generator=gen) > 0.4).float())
        assert 0 < float(s.alive.mean()) < algo.LOSS_ROWS_MAX_SHARE
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))

    calls = {"actor": 0, "critic": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(Actor, "forward_rows", counted("actor", Actor.forward_rows))
    monkeypatch.setattr(Critic, "forward_rows", counted("critic", Critic.forward_rows))

    def terms_and_grads() -> tuple[dict, dict]:
        policy.zero_grad(set_to_none=True)
        terms = algo.loss_terms(policy, samples, cfg.algo)
        (terms["actor_loss"] + terms["critic_loss"]).backward()
        grads = {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}
        return {k: v.detach() for k, v in terms.items()}, grads

    rows_terms, rows_grads = terms_and_grads()
    groups = len(samples.groups)
    # a critic with one value per agent (not one per env, broadcast) takes the rows too
    per_agent = [s.values.shape[-1] == s.returns.shape[-1] for s in samples.groups.values()]
    want_critic = sum(per_agent) if rows_taken else 0
    assert calls == {"actor": groups if rows_taken else 0, "critic": want_critic}
    if not rows_taken:
        return
    clipped = [v for k, v in rows_terms.items() if k.endswith("clip_fraction")]
    assert any(float(v) > 0 for v in clipped)  # the clipped branch is in the comparison
    monkeypatch.setattr(algo, "LOSS_ROWS_MAX_SHARE", 0.0)  # every row, masked
    all_terms, all_grads = terms_and_grads()
    assert calls["actor"] == groups
    assert rows_terms.keys() == all_terms.keys() and rows_grads.keys() == all_grads.keys()
    for k in all_terms:
        torch.testing.assert_close(rows_terms[k], all_terms[k], atol=1e-5, rtol=1e-5)
    for k in all_grads:
        torch.testing.assert_close(rows_grads[k], all_grads[k], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("machine", "native"), [("x86_64", True), ("x86_64", False), ("aarch64", False)]
)
def test_bf16_on_a_cpu_that_emulates_it_warns(machine, native, monkeypatch):
    """Without AMX or AVX512-BF16 an x86 CPU emulates bfloat16 products (18x slower than float32
    on an AVX2 CPU): the run says so and names the fix; with either, or on an ARM CPU (whose
    bf16 support torch does not report), it starts quietly."""
    import warnings

    monkeypatch.setattr("mappo.resources.platform.machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    cfg = C.load(None, {**TINY, "env.name": "toy/match", "model.precision": "bf16"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(cfg).close()
    messages = [str(w.message) for w in caught if "bf16" in str(w.message)]
    if native or machine == "aarch64":
        assert messages == []
    else:
        assert messages == [
            "model.precision=bf16 on a CPU without AMX or AVX512-BF16: torch emulates bfloat16 "
            "products here, many times slower than float32; set model.precision=fp32"
        ]


@pytest.mark.parametrize("recurrent", ["none", "gru"])
def test_bf16_networks_compute_in_bf16_and_hand_out_float32(recurrent):
    """``model.precision=bf16``: the networks' linear layers run in bfloat16, their outputs,
    states, parameters and the losses stay float32 and near the float32 networks' (bf16 has 8
    bits of mantissa); an update moves the parameters, and the rollout's log-probabilities are
    what the update's first pass recomputes (the first ratio is about 1)."""
    from mappo.algos import mappo as algo

    overrides = {
        "env.name": "toy/match",
        "env.kwargs": {"masks": True, "deaths": True},
        "rollout_length": 10,
        "model.recurrent": recurrent,
        **({} if recurrent == "none" else {"algo.data_chunk_length": 5}),
    }
    wide = _collected({**overrides, "model.precision": "bf16"})
    narrow = _collected(overrides)
    assert torch.equal(
        wide.policy.actors["agents"].head.weight, narrow.policy.actors["agents"].head.weight
    )
    seen: list[torch.dtype] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        for m in wide.policy.modules()
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "AgentLinear"
    ]
    cfg = wide.cfg
    samples = make_samples(wide.policy, wide.collector.rollout, cfg.algo, recurrent != "none")
    s = samples.groups["agents"]
    dist, state = wide.policy.actors["agents"](
        s.obs, s.actor_state, samples.starts, s.action_mask, s.actor_inject
    )
    for h in hooks:
        h.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert state.dtype == torch.float32
    log_probs = dist.log_prob(s.actions)
    assert log_probs.dtype == torch.float32
    ref, _ = narrow.policy.actors["agents"](
        s.obs, s.actor_state, samples.starts, s.action_mask, s.actor_inject
    )
    valid = samples.valid.bool()
    torch.testing.assert_close(
        log_probs[valid], ref.log_prob(s.actions)[valid], atol=0.05, rtol=0.05
    )
    # the rollout stored the bf16 network's log-probabilities: the first ratio is near 1
    torch.testing.assert_close(log_probs[valid], s.log_probs[valid], atol=0.02, rtol=0.02)
    terms = algo.loss_terms(wide.policy, samples, cfg.algo)
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in terms.values())
    assert float(terms["agents/approx_kl"]) < 1e-3
    before = [p.detach().clone() for p in wide.policy.parameters()]
    wide.learner.iterate(wide.iteration, wide.env_steps)
    after = list(wide.policy.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_nan_from_the_env_late_in_a_run_is_blamed_on_the_env(tmp_path):
    """An env that returns NaN rewards only after its first outputs (past the early checks)
    makes the losses NaN: the error says the env did it, not the learning rates."""
    from toy_env import MatchEnv

    from mappo.envs.registry import register
    from mappo.trainer import TrainingDiverged

    class LateNaN(MatchEnv):
        def _step(self, actions):  # noqa: ANN001, ANN202
            out = super()._step(actions)
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls > 20:
                out.reward = {"agents": out.reward["agents"] * float("nan")}
            return out

    register("toy/late_nan", LateNaN)
    cfg = C.load(
        "mpe/simple_spread",
        [
            "env.name=toy/late_nan", "env.num_envs=4", "rollout_length=16", "model.recurrent=none",
            "total_env_steps=640", "eval_episodes=2", "progress=false", "threads=1",
            f"run_dir={tmp_path}",
        ],
    )  # fmt: skip
    with pytest.raises(TrainingDiverged, match="the env returned NaN or inf \\(rewards of group"):
        train(cfg)
    # The seeds of a stacked run are told the same (they were told to lower the learning rates).
    from mappo.trainer import train_seeds

    stacked = C.apply(cfg, {"num_seeds": 2, "run_dir": str(tmp_path / "stacked")})
    with pytest.raises(TrainingDiverged, match="the env returned NaN or inf \\(rewards of group"):
        train_seeds(stacked)


def test_train_names_the_argument_types_it_takes():
    with pytest.raises(TypeError, match="give a preset name, a YAML path or a TrainConfig"):
        train(5)
    with pytest.raises(TypeError, match="overrides are a dict"):
        train("mpe/simple_spread", "total_env_steps=10")


def test_an_episode_limit_shorter_than_the_episodes_is_an_error_not_a_zero_return(tmp_path):
    """An evaluation stops after spec.episode_limit steps: an episode still running then would
    count with a return of 0, so a spec that understates the limit is refused by name."""
    import dataclasses

    from toy_env import MatchEnv

    from mappo.envs.base import EnvError
    from mappo.envs.registry import register

    def understated(**kwargs):  # noqa: ANN003, ANN202
        env = MatchEnv(**kwargs)  # episodes of 6 steps
        env.spec = dataclasses.replace(env.spec, episode_limit=3)
        return env

    register("toy/understated", understated)
    cfg = C.load(
        "mpe/simple_spread",
        [
            "env.name=toy/understated", "env.num_envs=4", "rollout_length=6",
            "model.recurrent=none", "total_env_steps=48", "eval_episodes=2", "progress=false",
            "threads=1", f"run_dir={tmp_path}",
        ],
    )  # fmt: skip
    with pytest.raises(EnvError, match="2 of 2 episodes did not end within spec.episode_limit=3"):
        train(cfg)


def test_groups_observed_for_different_numbers_of_envs_are_one_clear_error(tmp_path):
    """Two groups whose observations cover different numbers of envs (a slip when assembling
    them by hand) were a raw torch shape error inside the networks."""
    run = train("mpe/simple_speaker_listener", {**TINY, "run_dir": str(tmp_path)})
    policy = mappo.load_policy(run.dir)
    step = mappo.envs.make("mpe/simple_speaker_listener", num_envs=4, seed=0).reset()
    obs = dict(step.obs)
    obs["listener"] = obs["listener"][:3]
    with pytest.raises(ValueError) as info:
        policy.act(obs)
    assert str(info.value) == (
        "observations of the groups are for different numbers of envs {'speaker': 4, "
        "'listener': 3}; give every group's observations for the same envs, [num_envs, "
        "agents, ...]"
    )
    assert {g: a.shape[0] for g, a in policy.act(step.obs).items()} == {"speaker": 4, "listener": 4}


def test_phase_timings_wait_for_a_gpu(monkeypatch):
    # A GPU runs behind the host: without a wait, the rollout's kernels were timed in the update.
    from mappo.learners.ppo import clock

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    clock(torch.device("cpu"))
    assert waited == []
    clock(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]


def test_a_notebooks_loop_of_train_leaves_its_config_and_torch_settings_alone(tmp_path):
    """What a notebook does between and around calls: ``train(base, overrides)`` in a loop over
    one base config (each run gets its own overrides only, the base is not changed), inside
    ``torch.no_grad()`` and with float64 as torch's default dtype (both left to the caller),
    NumPy scalars as override values, a recurrent policy acting and evaluated afterwards."""
    import numpy as np

    base = mappo.load_config("mpe/simple_spread")
    before = C.to_dict(base)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            runs = [
                train(base, {**TINY, "seed": seed, "run_dir": str(tmp_path / f"s{seed}")})
                for seed in np.arange(1, 3)
            ]
            assert not torch.is_grad_enabled()
        assert torch.get_default_dtype() == torch.float64
        assert C.to_dict(base) == before
        assert [r.config.seed for r in runs] == [1, 2] and runs[0].config is not base
        assert all(isinstance(r.config.seed, int) for r in runs)
        value = {k: v for k, v in TINY.items() if k != "algo.epochs"}
        qmix = train(
            base,
            {
                **value,
                "algo.name": "qmix",
                "algo.lr": np.float32(0.001),
                "run_dir": str(tmp_path / "q"),
            },
        )
        assert qmix.config.algo.name == "qmix" and C.to_dict(base) == before
        policy = mappo.load_policy(runs[0].dir)
        env = mappo.envs.make("mpe/simple_spread", num_envs=3, seed=0)
        assert policy.act(env.reset(seed=0))["agents"].shape == (3, 3, 1)
        result = policy.evaluate(episodes=4, seed=1)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert math.isfinite(result["eval_return_mean"]) and result["eval_episodes"] == 4
    metrics = runs[0].metrics()
    assert len(metrics["env_steps"]) >= 1 and metrics["env_steps"][-1] >= 300
    assert "mpe/simple_spread" in repr(policy) and "rmappo" in repr(policy)


def test_a_config_edited_in_code_is_converted_as_loading_converts_it(tmp_path):
    """Values that loading converts (5.0 epochs, "8" episodes, compile: true) train as such
    from a config edited in code, and every entry point takes the same forms of overrides."""
    cfg = mappo.load_config(Path(C.PRESET_DIR) / "mpe/simple_spread.yaml", ("seed=3",))
    assert cfg.seed == 3
    cfg.algo.epochs = 1.0
    cfg.eval_episodes = "2"
    tiny = {k: v for k, v in TINY.items() if k not in ("algo.epochs", "eval_episodes")}
    run = train(cfg, {**tiny, "run_dir": str(tmp_path / "run")})
    assert run.config.algo.epochs == 1 and isinstance(run.config.algo.epochs, int)
    assert run.config.eval_episodes == 2
    assert cfg.algo.epochs == 1.0  # (the caller's object as it was)
    for call in (
        lambda: mappo.resume(run.dir, "total_env_steps=600"),
        lambda: mappo.resume_seeds([run.dir], "total_env_steps=600"),
        lambda: mappo.load_config("mpe/simple_spread", "seed=2"),
    ):
        with pytest.raises(TypeError, match="overrides are a dict"):
            call()
    with pytest.raises(TypeError, match="give a preset name or a YAML path, got int"):
        mappo.load_config(5)
    resumed = mappo.resume(run.dir, ("total_env_steps=1200",))
    assert resumed.summary["env_steps"] >= 1200


def test_the_package_reaches_its_subpackages_and_errors_by_attribute():
    import subprocess

    probe = (
        "import mappo\n"
        "env = mappo.envs.make('mpe/simple_spread', num_envs=2)\n"
        "assert issubclass(mappo.ConfigError, ValueError) and mappo.RunInterrupted\n"
        "assert 'envs' in dir(mappo) and 'importlib' not in dir(mappo)\n"
        "try:\n"
        "    mappo.nothing_here\n"
        "except AttributeError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "module 'mappo' has no attribute 'nothing_here'"


def test_a_finished_run_killed_before_its_summary_gets_one_on_resume(tmp_path):
    """A run killed between its final checkpoint and summary.json trained its budget: resuming
    it writes the summary from that checkpoint (reports count it complete) and says so."""
    from mappo.experiments.runs import read_run

    run = train("mpe/simple_spread", {**TINY, "run_dir": str(tmp_path)})
    (run.dir / "summary.json").unlink()
    assert not read_run(run.dir).complete
    with pytest.raises(C.ConfigError, match="stopped before writing its summary, which is now"):
        resume(run.dir)
    assert read_run(run.dir).complete
    with pytest.raises(C.ConfigError, match=r"already reached total_env_steps=600 \(600 steps\); "):
        resume(run.dir)


def test_policy_evaluate_checks_its_arguments_and_trusts_as_eval_does(tmp_path, monkeypatch):
    """Policy.evaluate: sampled evaluations repeat from their seed; words that are not the env's
    parameters are named; a saved run whose env name imports a module is refused until that
    module is trusted (opening a file runs no code it names), as ``mappo eval`` refuses it."""
    import numpy as np
    import yaml

    run = train("mpe/simple_spread", {**TINY, "run_dir": str(tmp_path)})
    policy = run.load_policy()
    first = policy.evaluate(episodes=np.int64(3), seed=5, deterministic=False)
    assert policy.evaluate(episodes=3, seed=5, deterministic=False) == first
    for kwargs, error, message in [
        ({"num_envs": 3}, ValueError, "use episodes=N"),
        ({"device": "cpu"}, ValueError, "load_policy\\(device=\\)"),
        ({"deterministic": "no"}, TypeError, "True or False"),
        ({"seed": 1.5}, TypeError, "are integers"),
        ({"episodes": 0}, ValueError, "positive integer"),
    ]:
        with pytest.raises(error, match=message):
            policy.evaluate(**kwargs)
    with pytest.raises(ValueError, match="positive integer, got True"):
        policy.evaluate(episodes=True)
    with torch.inference_mode():  # (a notebook's habit; training and loading turn it off)
        again = train("mpe/simple_spread", {**TINY, "run_dir": str(tmp_path / "in_inference")})
        assert mappo.load_policy(again.dir).evaluate(episodes=2)["eval_episodes"] == 2
    # A checkpoint whose config names an env of a module nobody trusted: the module is not
    # imported (its top-level code would write the marker).
    (tmp_path / "untrusted_envs_module.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ckpt_path = sorted((run.dir / "checkpoints").glob("iter_*.pt"))[-1]
    ckpt = torch.load(ckpt_path, weights_only=True)
    ckpt["config"]["env"]["name"] = "python:untrusted_envs_module:Env"
    torch.save(ckpt, tmp_path / "foreign.pt")
    foreign = mappo.load_policy(tmp_path / "foreign.pt")
    with pytest.raises(mappo.EnvError, match="if you trust the code of 'untrusted_envs_module'"):
        foreign.evaluate(episodes=2)
    assert not (tmp_path / "imported").exists()
    assert (
        yaml.safe_load((run.dir / "config.yaml").read_text())["env"]["name"] == "mpe/simple_spread"
    )


@pytest.mark.parametrize("when", ["periodic_evaluation", "final_evaluation", "rollout"])
def test_a_signal_gives_up_a_periodic_evaluation_under_way(tmp_path, monkeypatch, capsys, when):
    """An evaluation of long episodes may take minutes: a stop signal that arrives during a
    periodic one ends it at its next step, and the run stops with that iteration's checkpoint
    and no evaluation in its row. So does the final one: the training is complete and saved
    (a scheduler's SIGKILL after its grace period would otherwise lose it), and the message
    says to evaluate it with mappo eval. An evaluation that starts after the signal came
    (during the rollout) is waited for."""
    import mappo.learners.ppo as P
    import mappo.trainer as T

    def signal_then(real):
        def call(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # the run's handler takes it: a first signal
            return real(*args, **kwargs)

        return call

    if when == "rollout":
        monkeypatch.setattr(P.PPOLearner, "iterate", signal_then(P.PPOLearner.iterate))
    else:
        monkeypatch.setattr(T, "evaluate", signal_then(T.evaluate))
    over = {
        "env.num_envs": 4,
        "rollout_length": 25,
        "total_env_steps": 100 * (1 if when == "final_evaluation" else 3),
        "eval_interval": 1,
        "eval_episodes": 2,
        "threads": 1,
        "progress": False,
        "tensorboard": False,
        "run_dir": str(tmp_path),
    }
    if when == "final_evaluation":
        with pytest.raises(mappo.RunInterrupted) as info:
            train("mpe/simple_spread_mappo", over)
        assert info.value.evaluation_stopped and info.value.env_steps == 100
        progress = load_checkpoint(latest_checkpoint(info.value.run_dir))["progress"]
        assert progress["env_steps"] == 100
        assert progress["last_eval"] == {}  # (an older evaluation is not the final one)
        assert main(["eval", str(info.value.run_dir), "--episodes", "2"]) == 0
        argv = ["train", "mpe/simple_spread_mappo", f"run_dir={tmp_path / 'cli'}"]
        argv += [f"{k}={v}" for k, v in over.items() if k != "run_dir"]
        capsys.readouterr()
        assert main(argv) == 128 + signal.SIGINT
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "interrupted during the final evaluation at env step 100" in line
        assert "evaluate it with: mappo eval" in line
        return
    with pytest.raises(mappo.RunInterrupted) as info:
        train("mpe/simple_spread_mappo", over)
    run_dir = info.value.run_dir
    assert info.value.env_steps == 100 and info.value.saved_at_stop
    progress = load_checkpoint(latest_checkpoint(run_dir))["progress"]
    assert progress["env_steps"] == 100
    # the given-up evaluation is counted: the next one draws the seed it draws uninterrupted
    assert progress["eval_count"] == 1
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert len(rows) == 1
    assert bool(rows[0].get("eval/eval_return_mean")) == (when == "rollout")


def test_recurrent_actors_beside_feed_forward_critics(tmp_path):
    """``model.recurrent_critic=false`` (EPyMARL's and CleanMARL's recurrent MAPPO and IPPO):
    the actors keep their GRU, the critics have none and their values depend on the step's
    input alone; the run trains on chunks and resumes as the uninterrupted one, bit for bit.
    The key is refused where nothing reads it."""
    over = {**RESUME, "model.recurrent_critic": False}
    full = train("mpe/simple_spread", {**over, "run_dir": str(tmp_path / "a")})
    names = [n for n, _ in full.policy.named_parameters()]
    assert any(n.startswith("actors.") and ".rnn." in n for n in names)
    assert not any(n.startswith("critics.") and ".rnn." in n for n in names)
    (critic,) = full.policy.critics.values()
    assert critic.state_size == 0
    x = torch.randn(5, 4, 1, critic.in_features)
    state = torch.zeros(4, 1, 0)
    v_fresh, _ = critic(x, state, torch.ones(5, 4, dtype=torch.bool))
    v_going, _ = critic(x, state, torch.zeros(5, 4, dtype=torch.bool))
    torch.testing.assert_close(v_fresh, v_going, rtol=0, atol=0)
    torch.testing.assert_close(v_fresh[2:], critic(x[2:], state, torch.ones(3, 4).bool())[0])

    part = train("mpe/simple_spread", {**over, "run_dir": str(tmp_path / "b")})
    for p in sorted((part.dir / "checkpoints").glob("iter_*.pt")):
        if p.name > "iter_00000004.pt":
            p.unlink()
    resumed = resume(part.dir)
    a, b = _params(full.policy), _params(resumed.policy)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    with pytest.raises(C.ConfigError, match="'model.recurrent_critic' chooses whether"):
        C.load("mpe/simple_spread_mappo", ["model.recurrent_critic=false"])
    with pytest.raises(C.ConfigError, match="'model.recurrent_critic' is read by algo.name"):
        C.load("smac/3m_qmix", ["model.recurrent_critic=false"])


@pytest.mark.parametrize("recurrent", ["none", "gru"])
def test_the_critics_may_be_wider_than_the_actors(tmp_path, recurrent):
    """``model.critic_hidden_sizes`` (CleanMARL's MAPPO: actors 32 wide, critic 64): the critics'
    layers take it, the actors keep ``model.hidden_sizes``, and a run trains and resumes."""
    over = {**TINY, "model.recurrent": recurrent, "model.hidden_sizes": [8, 8]}
    over |= {"model.critic_hidden_sizes": [16], "run_dir": str(tmp_path)}
    run = train("mpe/simple_spread_mappo", over)
    policy = mappo.load_policy(run.dir).model
    # the first dense layer of each trunk (after the input LayerNorm): [copies, in, out]
    widths = {n: p.shape for n, p in policy.named_parameters() if n.endswith("mlp.net.1.weight")}
    assert {n.split(".")[0] for n in widths} == {"actors", "critics"}
    for name, shape in widths.items():
        assert shape[-1] == (16 if name.startswith("critics") else 8), name
    more = resume(run.dir, {"total_env_steps": 2 * over["total_env_steps"]})
    assert more.summary["env_steps"] == 2 * over["total_env_steps"]
    with pytest.raises(C.ConfigError, match="'model.critic_hidden_sizes' is read by algo.name"):
        C.load("mpe/simple_spread_qmix", ["model.critic_hidden_sizes=[16]"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["spec"].update(groups=[]), r"damaged mappo checkpoint \(its env spec"),
        (lambda d: d["spec"].update(state_shape="x"), r"damaged mappo checkpoint \(its env spec"),
        (lambda d: d["progress"].update(env_steps="x"), r"progress 'env_steps' is 'x'"),
        (lambda d: d.update(format=99), "checkpoint format 99 by a newer mappo; this one reads"),
    ],
)
def test_a_checkpoint_altered_past_its_loader_is_refused_and_passed_over(tmp_path, change, message):
    """Fields that torch loads safely but that nothing can read back (an env spec or counters
    of the wrong type, a newer format) are refused when the file is loaded, so that a run
    directory falls back to its older checkpoint instead of failing later in a traceback."""
    from mappo.api import load_policy
    from mappo.checkpoint import CheckpointError

    over = {**TINY, "checkpoint_interval": 1, "run_dir": str(tmp_path), "threads": 1}
    run = train("mpe/simple_spread_ff_fast", over)
    newest = latest_checkpoint(run.dir)
    data = torch.load(newest, weights_only=True)
    change(data)
    torch.save(data, newest)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(newest)
    with pytest.warns(UserWarning, match=message):
        policy = load_policy(run.dir)
    assert policy.checkpoint != newest
    # a summary.json nested past the JSON parser's depth is an unreadable one, not a traceback
    (run.dir / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["report", str(run.dir)]) == 0
