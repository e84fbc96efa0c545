"""Training on third-party environments through the adapters, from the command line.

The presets for PettingZoo's Spread, Level-Based Foraging and the Multi-Robot Warehouse follow
the EPyMARL benchmark's protocol (Papoudakis et al. 2021) and train end to end; short runs on LBF
and on RWARE learn, measured against uniformly random actions on the same episodes.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mappo import config as C
from mappo.cli import main
from mappo.envs import make

# preset -> (environment, episode limit, env steps of the paper's on-policy runs)
PRESETS: dict[str, tuple[str, int, int]] = {
    "pettingzoo/simple_spread": ("pettingzoo:mpe2.simple_spread_v3", 25, 20_000_000),
    "lbf/8x8-2p-2f": ("gymnasium:lbforaging:Foraging-8x8-2p-2f-v3", 50, 20_000_000),
    "lbf/2s-8x8-2p-2f-coop": ("gymnasium:lbforaging:Foraging-2s-8x8-2p-2f-coop-v3", 50, 20_000_000),
    "rware/tiny-2ag": ("gymnasium:rware:rware-tiny-2ag-v2", 500, 40_000_000),
    "rware/tiny-4ag": ("gymnasium:rware:rware-tiny-4ag-v2", 500, 40_000_000),
}

# The learning checks trade the presets' paper settings for speed: 32 copies x 25 steps, a
# feed-forward 64x64 network, a larger learning rate and entropy bonus; everything else
# (critic, agent ids, epochs, losses) stays as the preset has it.
FAST = [
    "env.num_envs=32",
    "rollout_length=25",
    "model.recurrent=none",
    "model.hidden_sizes=[64,64]",
    "algo.actor_lr=0.001",
    "algo.critic_lr=0.001",
    "algo.entropy_coef=0.01",
    "eval_interval=0",
    "eval_episodes=8",
    "log_interval=5",
    "checkpoint_interval=1000",
    "threads=1",
    "progress=false",
    "tensorboard=false",
]

SMALL_WAREHOUSE = "x.x\n...\n.g."
"""Two shelves, six highway cells and a goal (RWARE's layout syntax: x shelf, . highway, g goal):
a delivery takes a few steps, so the sparse reward is met often enough to learn from quickly."""


def _kwargs_override(preset: str, **changes: Any) -> str:
    """``env.kwargs=...`` with the preset's own environment arguments updated by ``changes``."""
    kwargs = {**C.load(preset).env.kwargs, **changes}
    return "env.kwargs=" + json.dumps(kwargs)  # JSON is YAML: the override parser reads it


def _only_run(root: Path) -> Path:
    (summary,) = root.rglob("summary.json")
    return summary.parent


def _train(preset: str, root: Path, overrides: list[str]) -> Path:
    assert main(["train", preset, *overrides, f"run_dir={root}"]) == 0
    return _only_run(root)


def _sampled_return(run: Path, episodes: int, seed: int, capsys: pytest.CaptureFixture) -> float:
    """Mean per-agent return of the trained policy, actions sampled (``mappo eval --sample``)."""
    capsys.readouterr()  # --sample draws from a generator seeded by --seed
    code = main(
        ["eval", str(run), "--sample", f"--episodes={episodes}", f"--seed={seed}", "--json"]
    )
    assert code == 0
    return float(json.loads(capsys.readouterr().out)["eval_return_mean"])


def _random_return(name: str, episodes: int, seed: int, **kwargs: Any) -> float:
    """Mean per-agent return of uniformly random actions over the first episode of ``episodes``
    copies reset with ``seed`` (the episodes ``mappo eval --seed`` plays)."""
    gen = torch.Generator().manual_seed(seed)
    with make(name, num_envs=episodes, seed=seed, num_workers=0, **kwargs) as env:
        env.reset(seed=seed)
        running = torch.zeros(episodes)
        first = torch.full((episodes,), math.nan)
        for _ in range(env.spec.episode_limit):
            actions = {
                g: torch.stack(
                    [
                        torch.randint(0, k, (episodes, s.num_agents), generator=gen)
                        for k in s.action.nvec
                    ],
                    dim=-1,
                )
                for g, s in env.spec.groups.items()
            }
            step = env.step(actions)
            running += torch.cat(list(step.reward.values()), dim=1).mean(1)
            first = torch.where(step.done & first.isnan(), running, first)
            running = torch.where(step.done, 0.0, running)
    assert not first.isnan().any()
    return float(first.mean())


def _train_returns(run: Path) -> list[float]:
    rows = csv.DictReader((run / "metrics.csv").open())
    return [float(r["train/episode_return"]) for r in rows if r.get("train/episode_return")]


# -- the presets --------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_presets_follow_the_epymarl_protocol(preset: str) -> None:
    name, limit, budget = PRESETS[preset]
    cfg = C.load(preset)
    assert cfg.env.name == name
    with make(name, num_envs=1, **{**cfg.env.kwargs, "num_workers": 0}) as env:
        assert env.spec.episode_limit == limit
    # EPyMARL's MAPPO: 10 envs, each update on the whole episodes just collected, 4 epochs on
    # one batch, shared parameters with agent ids, a centralised critic.
    assert cfg.env.num_envs == 10 and cfg.rollout_length == limit
    assert (cfg.algo.epochs, cfg.algo.num_minibatches, cfg.algo.clip) == (4, 1, 0.2)
    assert cfg.model.share_params and cfg.model.agent_id and cfg.algo.critic_input == "state"
    # The paper's budget, evaluated 40 times on 100 greedy episodes (plus its step-0 evaluation).
    assert cfg.total_env_steps == budget
    assert cfg.num_updates % cfg.eval_interval == 0
    assert cfg.num_updates // cfg.eval_interval == 40 and cfg.eval_episodes == 100


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_from_the_command_line(
    preset: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _train(
        preset,
        tmp_path,
        [
            "env.num_envs=2",
            "rollout_length=8",
            "total_env_steps=32",
            "algo.epochs=1",
            "eval_episodes=2",
            "eval_interval=1",
            "log_interval=1",
            "checkpoint_interval=1",
            "progress=false",
            "tensorboard=false",
            _kwargs_override(preset, num_workers=0),
        ],
    )
    assert "result:" in capsys.readouterr().out
    name = PRESETS[preset][0]
    assert run.parent == tmp_path / preset / "rmappo"  # named after the preset
    assert C.load(str(run / "config.yaml")).env.name == name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["env_steps"] == 32 and summary["iterations"] == 2
    assert math.isfinite(summary["eval_return_mean"])
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["iteration"] for r in rows] == ["1", "2"]
    losses = {k: float(v) for r in rows for k, v in r.items() if k.startswith("loss/") and v}
    assert any(k.endswith("/value_loss") for k in losses)
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "iter_00000001.pt",
        "iter_00000002.pt",
    ]


def test_an_lbf_team_return_is_the_fraction_of_food_collected() -> None:
    """The reading of the EPyMARL paper's LBF numbers (docs/custom_envs.md): the agents' rewards
    of an episode add up to the fraction of the food collected, 1 when all of it is (the episode
    then terminates); ``episode_return`` is their mean over the agents."""
    gen = torch.Generator().manual_seed(0)
    with make("gymnasium:lbforaging:Foraging-5x5-2p-2f-v3", num_envs=64, num_workers=0) as env:
        env.reset(seed=0)
        cleared, cut = [], []
        for _ in range(150):
            step = env.step({"agent": torch.randint(0, 6, (64, 2, 1), generator=gen)})
            team = 2 * step.stats["episode_return"]
            cleared.append(team[step.terminated])
            cut.append(team[step.truncated])
    cleared, cut = torch.cat(cleared), torch.cat(cut)
    assert len(cleared) > 20 and len(cut) > 20
    assert torch.allclose(cleared, torch.ones_like(cleared), atol=1e-5)
    # Cut at the 50-step limit: any fraction (all of it when the last item goes at step 50).
    assert (cut >= 0).all() and (cut <= 1 + 1e-5).all() and (cut < 1 - 1e-5).any()


@pytest.mark.parametrize("limit", [20, 120])
def test_max_episode_steps_sets_lbfs_own_step_limit(limit: int) -> None:
    """``env.kwargs.max_episode_steps`` is LBF's own constructor argument: longer episodes than
    the registered 50 as well as shorter ones (``gymnasium.make`` would keep the word for its
    TimeLimit wrapper, and LBF ended every episode at 50 whatever was asked)."""
    name = "gymnasium:lbforaging:Foraging-8x8-2p-2f-v3"
    with make(name, num_envs=2, num_workers=0, max_episode_steps=limit) as env:
        assert env.spec.episode_limit == limit
        env.reset(seed=0)
        still = torch.zeros(2, 2, 1, dtype=torch.long)  # no-ops: nothing is collected
        for t in range(1, limit + 1):
            step = env.step({"agent": still})
            assert bool(step.truncated.all()) == (t == limit)


# -- learning -----------------------------------------------------------------------------------
def test_a_short_lbf_run_learns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Foraging-8x8-2p-2f: random actions collect ~18% of the food (0.09 per agent); after 60k
    steps the sampled policy collects 75-94% (3 seeds: 0.38-0.47 per agent). Greedy evaluation
    lags at this stage: a policy that still samples well can repeat the same move (or a useless
    load) in the same state forever, so the check samples actions as the policy was trained."""
    preset = "lbf/8x8-2p-2f"
    run = _train(preset, tmp_path, [*FAST, "total_env_steps=60000", "seed=1"])
    learned = _sampled_return(run, episodes=100, seed=7, capsys=capsys)
    random = _random_return(PRESETS[preset][0], episodes=100, seed=7)
    first = _train_returns(run)[0]
    assert learned >= 2.5 * random and learned >= random + 0.15, (learned, random)
    assert learned >= first + 0.1, (learned, first)


def test_a_short_rware_run_learns_on_a_small_warehouse(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """RWARE's tiny layout is too sparse to learn from in a test (random agents deliver about
    one shelf per 20 episodes of 500 steps), so this run uses a 3x3 warehouse with one request at
    a time and 100-step episodes. Random actions deliver ~0.2 shelves per episode (0.1 per
    agent); after 50k steps the sampled policy delivers 2.2-3.9 per agent (3 seeds)."""
    preset = "rware/tiny-2ag"
    env_args = {"layout": SMALL_WAREHOUSE, "max_steps": 100, "request_queue_size": 1}
    run = _train(
        preset,
        tmp_path,
        [*FAST, "total_env_steps=50000", "seed=1", _kwargs_override(preset, **env_args)],
    )
    learned = _sampled_return(run, episodes=50, seed=7, capsys=capsys)
    random = _random_return(PRESETS[preset][0], episodes=50, seed=7, **env_args)
    first = _train_returns(run)[0]
    assert learned >= 1.0 and learned >= 5 * random, (learned, random)
    assert learned >= first + 0.5, (learned, first)


def test_evaluation_cuts_the_run_s_worker_count_to_its_episodes(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Two workers for two training copies; the one evaluation episode (in training, and from
    # `mappo eval`) gets one worker instead of a refusal.
    preset = "pettingzoo/simple_spread"
    overrides = [
        "env.num_envs=2",
        "rollout_length=4",
        "total_env_steps=8",
        "algo.epochs=1",
        "eval_episodes=1",
        "eval_interval=1",
        "progress=false",
        "tensorboard=false",
        _kwargs_override(preset, num_workers=2),
    ]
    run = _train(preset, tmp_path, overrides)
    assert json.loads((run / "summary.json").read_text())["eval_episodes"] == 1
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_episodes"] == 1


def test_fit_workers_cuts_only_a_worker_count_above_the_batch() -> None:
    from mappo.envs.registry import fit_workers

    assert fit_workers({"num_workers": 4, "N": 3}, 2) == {"num_workers": 2, "N": 3}
    assert fit_workers({"num_workers": 2}, 8) == {"num_workers": 2}
    assert fit_workers({"N": 3}, 1) == {"N": 3}


def test_a_resumed_adapter_run_says_its_episodes_start_afresh(tmp_path: Path) -> None:
    """A wrapped env's state is Python objects, which a checkpoint loaded with weights_only
    cannot hold: a MAPPO resume starts fresh episodes, and says so (the README's exact-resume
    promise holds for the batched envs)."""
    import mappo
    from mappo.checkpoint import CheckpointWarning

    over = {
        "env.num_envs": 2,
        "env.kwargs.num_workers": 0,
        "rollout_length": 25,
        "total_env_steps": 100,
        "checkpoint_interval": 1,
        "eval_episodes": 2,
        "progress": False,
        "threads": 1,
        "run_dir": str(tmp_path),
    }
    run = mappo.train("pettingzoo/simple_spread", over)
    with pytest.warns(CheckpointWarning, match="its episodes start afresh at this resume"):
        resumed = mappo.resume(run.dir, {"total_env_steps": 150})
    assert resumed.summary["env_steps"] >= 150


def test_fresh_episodes_keep_the_finished_ones_not_yet_logged() -> None:
    """At such a resume the running episodes are forgotten (their envs start new ones) and the
    episodes that ended before the checkpoint but were not logged yet still count."""
    from mappo.rollout import EpisodeTracker

    tracker = EpisodeTracker.create(2, ("won",), torch.device("cpu"))
    tracker.returns.fill_(3.0)
    tracker.lengths.fill_(7.0)
    tracker.finished.fill_(2.0)
    tracker.return_sum.fill_(5.0)
    tracker.length_sum.fill_(20.0)
    tracker.fresh_episodes()
    assert tracker.returns.tolist() == [0.0, 0.0] and tracker.lengths.tolist() == [0.0, 0.0]
    assert tracker.read() == {
        "episode_return": 2.5,
        "episode_length": 10.0,
        "won": 0.0,
        "episodes": 2.0,
    }
