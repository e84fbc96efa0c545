"""Image observations: the convolutional encoder (``model.encoder=cnn``) and the grid world that
is observed as pictures (``grid/spread``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mappo import config as config_mod
from mappo.cli import main
from mappo.config import AlgoConfig, ConfigError, ModelConfig
from mappo.envs import EnvError, make
from mappo.nn.actor_critic import ActorCritic
from mappo.nn.layers import ConvEncoder, image_layout
from mappo.nn.q_agents import AgentNetworks
from mappo.trainer import Trainer, resume, train

# -- the encoder ---------------------------------------------------------------------------


def _encoder(copies: int, extra: int = 0, channels_last: bool = True) -> ConvEncoder:
    shape = (3, 6, 5, channels_last)  # 3 channels, 6 x 5 pixels
    layers = [(4, 3, 1), (2, 2, 2)]
    return ConvEncoder(3 * 6 * 5 + extra, shape, layers, "relu", copies, scale=0.5)


def test_the_encoder_is_two_convolutions_on_the_scaled_image_with_the_rest_appended() -> None:
    torch.manual_seed(0)
    enc = _encoder(copies=1, extra=2)
    # 6 x 5 -> 4 x 3 (3x3, stride 1) -> 2 x 1 (2x2, stride 2), 2 channels; plus the 2 extras
    assert enc.out_features == 2 * 2 * 1 + 2
    x = torch.randn(4, 7, 1, 92)  # [L, B, C, in]
    y = enc(x)
    assert y.shape == (4, 7, 1, 6)
    image = x[..., :90].reshape(-1, 6, 5, 3).permute(0, 3, 1, 2) * 0.5
    c1, c2 = enc.net[0], enc.net[2]
    want = torch.relu(c2(torch.relu(c1(image)))).reshape(4, 7, 1, 4)
    torch.testing.assert_close(y[..., :4], want)
    torch.testing.assert_close(y[..., 4:], x[..., 90:])  # an agent id passes through


def test_channels_first_and_channels_last_read_the_same_picture() -> None:
    torch.manual_seed(0)
    last, first = _encoder(1), _encoder(1, channels_last=False)
    first.load_state_dict(last.state_dict())
    hwc = torch.rand(8, 1, 6, 5, 3)
    chw = hwc.permute(0, 1, 4, 2, 3)
    torch.testing.assert_close(last(hwc.flatten(2)), first(chw.flatten(2)))


def test_per_agent_filters_equal_one_encoder_per_agent() -> None:
    """copies=3: agent k's features come from its own image through its own filters only,
    as three separate encoders would compute them (one grouped convolution)."""
    torch.manual_seed(0)
    grouped = _encoder(copies=3, extra=1)
    x = torch.randn(5, 3, 91)
    y = grouped(x)
    for k in range(3):
        alone = _encoder(copies=1, extra=1)
        with torch.no_grad():
            for mine, theirs in zip(alone.net, grouped.net, strict=True):
                if isinstance(mine, torch.nn.Conv2d):
                    out = mine.out_channels
                    mine.weight.copy_(theirs.weight[k * out : (k + 1) * out])
                    mine.bias.copy_(theirs.bias[k * out : (k + 1) * out])
        torch.testing.assert_close(y[:, k], alone(x[:, k : k + 1])[:, 0])


def test_each_agent_s_filters_start_orthogonal() -> None:
    enc = _encoder(copies=2)
    conv = enc.net[0]
    for k in range(2):
        w = conv.weight[k * 4 : (k + 1) * 4].reshape(4, -1)  # [out, in * k * k]
        gain = math.sqrt(2.0)  # ReLU
        torch.testing.assert_close(w @ w.T, gain**2 * torch.eye(4), atol=1e-5, rtol=0)
    assert torch.all(conv.bias == 0)


@pytest.mark.parametrize(
    ("shape", "layout", "want"),
    [
        ((84, 84, 3), "auto", (3, 84, 84, True)),
        ((4, 84, 80), "auto", (4, 84, 80, False)),
        ((7, 7, 3), "auto", (3, 7, 7, True)),
        ((4, 4, 2), "auto", (2, 4, 4, True)),
        ((3, 3, 3), "hwc", (3, 3, 3, True)),
        ((3, 3, 3), "chw", (3, 3, 3, False)),
    ],
)
def test_the_colour_channels_are_found_or_named(shape, layout, want) -> None:
    assert image_layout(shape, layout, "x") == want


@pytest.mark.parametrize("shape", [(3, 8, 3), (16, 16, 16), (2, 2, 2)])
def test_an_image_whose_channels_cannot_be_told_asks_for_the_layout(shape) -> None:
    with pytest.raises(ConfigError, match="model.image_layout=hwc"):
        image_layout(shape, "auto", "group 'a''s observations")


def test_a_kernel_larger_than_its_maps_names_the_layer() -> None:
    with pytest.raises(ConfigError, match="convolution 2 of model.cnn_kernels has a 5x5 kernel"):
        ConvEncoder(75, (3, 5, 5, True), [(8, 3, 1), (8, 5, 1)], "relu", 1, 1.0)


# -- networks ------------------------------------------------------------------------------


def _grid_spec(**kwargs):
    return make("grid/spread", num_envs=2, seed=0, **kwargs).spec


def test_actor_and_critic_convolve_images_and_rows_match_the_batch() -> None:
    torch.manual_seed(0)
    env = make("grid/spread", num_envs=3, seed=0)
    net = ActorCritic(env.spec, ModelConfig(encoder="cnn", recurrent="none"), AlgoConfig())
    actor, critic = net.actors["agents"], net.critics["agents"]
    assert actor.trunk.encoder is not None and critic.trunk.encoder is not None
    assert actor.trunk.encoder.image == (3, 13, 13)  # [13, 13, 3] pictures, channels last
    assert critic.trunk.encoder.image == (2, 7, 7)  # the global [7, 7, 2] grid
    step = env.reset()
    obs = step.obs["agents"].unsqueeze(0)  # [1, E, n, 13, 13, 3]
    starts = torch.ones(1, 3, dtype=torch.bool)
    dist, _ = actor(obs, net.initial_states(3, env.device)[0]["agents"], starts, None)
    rows = torch.tensor([[[True, False, True], [False, True, False], [True, True, True]]])
    torch.testing.assert_close(
        actor.forward_rows(obs, rows, None).probs, dist.probs[rows], rtol=1e-5, atol=1e-6
    )
    x = net.critic_input("agents", step)
    values, _ = critic(x.unsqueeze(0), net.initial_states(3, env.device)[1]["agents"], starts)
    assert values.shape == (1, 3, 1) and torch.isfinite(values).all()


def test_an_mlp_network_reads_the_same_images_flat() -> None:
    net = ActorCritic(_grid_spec(), ModelConfig(recurrent="none"), AlgoConfig())
    assert net.actors["agents"].trunk.encoder is None
    first = net.actors["agents"].trunk.mlp.net[1]
    assert first.in_features == 13 * 13 * 3


def test_the_cnn_on_an_env_without_images_is_refused() -> None:
    spec = make("mpe/simple_spread", num_envs=1).spec
    with pytest.raises(ConfigError, match="model.encoder=cnn convolves inputs that are images"):
        ActorCritic(spec, ModelConfig(encoder="cnn"), AlgoConfig())


def test_value_family_agents_convolve_images_too() -> None:
    torch.manual_seed(0)
    spec = _grid_spec()
    cfg = config_mod.load("grid/spread", {"algo.name": "qmix"})
    nets = AgentNetworks(spec, cfg.model, "qmix", last_action=True)
    agent = nets.agents["agents"]
    assert agent.trunk.encoder is not None
    # the image first, then the previous action and nothing else
    assert agent.trunk.encoder.extra == 5
    obs = torch.rand(4, 2, 3, 13, 13, 3) * 255
    actions = torch.randint(0, 5, (4, 2, 3, 1))
    q = nets.unroll({"agents": obs}, {"agents": actions})["agents"]
    assert q.shape == (4, 2, 3, 5) and torch.isfinite(q).all()


# -- config --------------------------------------------------------------------------------


def test_the_convolutions_need_as_many_kernels_and_strides_as_channels() -> None:
    with pytest.raises(ConfigError, match="have 2, 1 and 1 entries"):
        config_mod.load("grid/spread", {"model.cnn_channels": [16, 32]})


def test_cnn_settings_without_the_cnn_are_refused() -> None:
    with pytest.raises(ConfigError, match="model.cnn_strides' is read with model.encoder=cnn"):
        config_mod.load("mpe/simple_spread", {"model.cnn_strides": [2]})


def test_the_command_line_refuses_the_cnn_on_flat_observations(capsys) -> None:
    code = main(["train", "mpe/simple_spread_fast", "model.encoder=cnn", "progress=false"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.encoder=cnn convolves inputs that are images" in err[0]


# -- the grid world ------------------------------------------------------------------------


def test_an_agent_sees_the_grid_from_its_own_cell() -> None:
    env = make("grid/spread", num_envs=1, seed=0, num_agents=2, size=4)
    env.reset()
    # agent 0 at (3, 0), agent 1 at (0, 2); targets at (0, 3) and (3, 1)
    env.set_state(
        {
            "agents": torch.tensor([[12, 2]]),
            "targets": torch.tensor([[3, 13]]),
            "t": torch.tensor([0]),
        }
    )
    obs = env._observe()[0][0] / 255  # [n, 7, 7, 3]
    others, targets, walls = obs[0].unbind(-1)
    assert others.nonzero().tolist() == [[0, 5]]  # (0, 2) is 3 rows up, 2 columns right
    assert targets.nonzero().tolist() == [[0, 6], [3, 4]]
    assert walls[4:].all() and walls[:, :3].all() and not walls[:4, 3:].any()
    assert obs[1, ..., 1].nonzero().tolist() == [[3, 4], [6, 2]]


def test_the_reward_is_minus_the_targets_distance_to_their_nearest_agent() -> None:
    env = make("grid/spread", num_envs=2, seed=0, num_agents=2, size=5)
    env.reset()
    env.set_state(
        {
            # env 0: agents at (0, 0) and (4, 4), targets at (0, 2) and (4, 4); env 1: both
            # agents at (2, 2), targets at (0, 0) and (2, 3)
            "agents": torch.tensor([[0, 24], [12, 12]]),
            "targets": torch.tensor([[2, 24], [0, 13]]),
            "t": torch.tensor([0, 0]),
        }
    )
    # env 0: agent 0 moves right (1 from its target), agent 1 stays; env 1: both stay
    step = env.step({"agents": torch.tensor([[[4], [0]], [[0], [0]]])})
    torch.testing.assert_close(step.reward["agents"][:, 0], torch.tensor([-1 / 5, -5 / 5]))
    torch.testing.assert_close(step.stats["covered"], torch.tensor([0.5, 0.0]))
    # a move off the grid stays put
    step = env.step({"agents": torch.tensor([[[1], [2]], [[0], [0]]])})
    assert env.agents[0].tolist() == [1, 24]


def test_episodes_end_by_truncation_and_restart_from_the_env_s_generator() -> None:
    a = make("grid/spread", num_envs=4, seed=3, length=5)
    b = make("grid/spread", num_envs=4, seed=3, length=5)
    sa, sb = a.reset(), b.reset()
    moves = torch.Generator().manual_seed(0)
    for t in range(12):
        act = torch.randint(0, 5, (4, 3, 1), generator=moves)
        sa, sb = a.step({"agents": act}), b.step({"agents": act})
        assert bool(sa.truncated.all()) == ((t + 1) % 5 == 0) and not sa.terminated.any()
        torch.testing.assert_close(sa.obs["agents"], sb.obs["agents"])
        if sa.truncated.all():
            assert sa.final_obs["agents"].shape == sa.obs["agents"].shape
    # a state put into a fresh env gives the same observations
    c = make("grid/spread", num_envs=4, seed=9, length=5)
    c.reset()
    torch.testing.assert_close(c.set_state(a.get_state()).obs["agents"], sa.obs["agents"])


def test_bad_grid_parameters_name_the_fix() -> None:
    with pytest.raises(EnvError, match="raise size or lower num_agents"):
        make("grid/spread", num_envs=1, num_agents=5, size=3)
    with pytest.raises(EnvError, match="size must be an integer >= 2"):
        make("grid/spread", num_envs=1, size=1)


def test_the_grid_renders_agents_and_targets() -> None:
    env = make("grid/spread", num_envs=2, seed=0)
    env.reset()
    frame = env.render(1, size=140)
    assert frame.shape == (140, 140, 3) and frame.dtype == np.uint8
    colours = {tuple(c) for c in frame.reshape(-1, 3)}
    assert (60, 90, 200) in colours and (90, 190, 90) in colours


# -- training ------------------------------------------------------------------------------

QUICK = {
    "env.num_envs": 8,
    "threads": 1,
    "progress": False,
    "tensorboard": False,
}


def _params(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


def test_a_short_run_with_the_cnn_learns_to_reach_a_target(tmp_path) -> None:
    """One agent, one target on a 4 x 4 grid: within 24k steps the greedy agent learns to
    walk to it (a random walk stays about 2 cells away)."""
    overrides = {
        **QUICK,
        "env.kwargs": {"num_agents": 1, "size": 4, "length": 8},
        "rollout_length": 8,
        "total_env_steps": 24_000,
        "eval_interval": 1000,
        "eval_episodes": 32,
        "algo.actor_lr": 0.003,
        "algo.critic_lr": 0.003,
        "run_dir": str(tmp_path),
        "seed": 1,
    }
    fresh = Trainer(config_mod.load("grid/spread", overrides))
    try:
        before = fresh.evaluate()["eval_return_mean"]
    finally:
        fresh.close()
    after = train("grid/spread", overrides).summary["eval_return_mean"]
    assert after > before + 0.5, (before, after)
    assert after > -1.5, (before, after)


def test_a_cnn_run_resumes_exactly(tmp_path) -> None:
    """Per-agent filters, stopped after its second checkpoint and resumed: the same
    parameters as the run never stopped."""
    over = {
        **QUICK,
        "total_env_steps": 8 * 20 * 4,
        "checkpoint_interval": 2,
        "eval_interval": 3,
        "model.share_params": False,
    }
    full = train("grid/spread", {**over, "run_dir": str(tmp_path / "a")})
    part = train("grid/spread", {**over, "run_dir": str(tmp_path / "b")})
    for p in (part.dir / "checkpoints").glob("iter_*.pt"):
        if p.name > "iter_00000002.pt":
            p.unlink()
    resumed = resume(part.dir)
    a, b = _params(full.policy), _params(resumed.policy)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert resumed.summary["eval_return_mean"] == full.summary["eval_return_mean"]


def test_large_images_are_warned_about_with_what_shrinks_them() -> None:
    import warnings

    from mappo.trainer import _warn_large_observations

    env = make("grid/spread", num_envs=1, size=60)  # [119, 119, 3] pictures: 42,483 values
    flat = config_mod.load("grid/spread", {"model.encoder": "mlp"})
    with pytest.warns(UserWarning, match="42,483 values per agent .*model.encoder=cnn"):
        _warn_large_observations(flat, env)
    # the paper's one 3x3 convolution of 32 channels, stride 1: 32 x 117 x 117 maps
    cnn = config_mod.load("grid/spread", {"model.cnn_channels": [32]})
    with pytest.warns(UserWarning, match="leave 438,048 values .*cnn_strides=\\[4,2,1\\]"):
        _warn_large_observations(cnn, env)
    nature = config_mod.load(
        "grid/spread",
        {
            "model.cnn_channels": [32, 64, 64],
            "model.cnn_kernels": [8, 4, 3],
            "model.cnn_strides": [4, 2, 1],
        },
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_large_observations(nature, env)  # 64 x 11 x 11 = 7,744 values


# -- PettingZoo and Gymnasium envs that observe pictures ------------------------------------


def _pictures(**overrides: object) -> dict:
    """Overrides of ``pettingzoo/simple_spread`` for :class:`PictureEnv` (in process, two
    copies, the CNN with 2x2 kernels), with ``overrides`` on top."""
    return {
        **QUICK,
        "env.name": "pettingzoo:test_adapter_envs:PictureEnv",
        "env.kwargs": {"num_workers": 0},
        "env.num_envs": 2,
        "eval_episodes": 2,
        "model.encoder": "cnn",
        "model.cnn_kernels": [2],
        **overrides,
    }


def test_the_adapter_keeps_an_image_s_axes() -> None:
    from test_adapter_envs import PictureEnv

    env = make("pettingzoo:test_adapter_envs:PictureEnv", num_envs=2, num_workers=0)
    try:
        assert env.spec.groups["painter"].obs_shape == (8, 7, 3)
        assert env.spec.state_shape == (4, 4, 2)
        step = env.reset(seed=0)
        ref = PictureEnv()
        ref.reset()
        torch.testing.assert_close(
            step.obs["painter"][0, 1], torch.from_numpy(ref.picture("painter_1")).float()
        )
        assert step.state.shape == (2, 4, 4, 2)
        for _ in range(4):
            step = env.step({"painter": torch.tensor([[[2], [1]], [[0], [0]]])})
            ref.step({"painter_0": 2, "painter_1": 1})
        # the last step ends the episodes: final pictures of the last step, fresh ones after
        assert step.truncated.all()
        torch.testing.assert_close(
            step.final_obs["painter"][0, 0], torch.from_numpy(ref.picture("painter_0")).float()
        )
        assert step.final_state.shape == (2, 4, 4, 2) and float(step.final_state[0].max()) == 40
        assert float(step.state.max()) == 0  # the new episodes' state
    finally:
        env.close()


def test_mappo_with_the_cnn_trains_on_a_pettingzoo_env_of_pictures(tmp_path) -> None:
    run = train(
        "pettingzoo/simple_spread",
        _pictures(rollout_length=8, total_env_steps=32, eval_interval=1000, run_dir=str(tmp_path)),
    )
    critic = run.policy.critics["painter"]
    assert run.policy.actors["painter"].trunk.encoder.image == (3, 8, 7)
    assert critic.trunk.encoder.image == (2, 4, 4)  # the env's state()
    assert math.isfinite(run.summary["eval_return_mean"])


def test_8_bit_pictures_are_stored_as_bytes() -> None:
    """A uint8 Box (pixels) and a uint8 state(): the rollout keeps them as bytes, a quarter
    of float32; float observations stay float32."""
    trainer = Trainer(config_mod.load("pettingzoo/simple_spread", _pictures(rollout_length=4)))
    try:
        assert trainer.env.byte_observations
        trainer.iterate()
        buf = trainer.learner.collector.rollout.groups["painter"]
        assert buf.obs.dtype == torch.uint8 and buf.critic_x.dtype == torch.uint8
        assert int(buf.obs.max()) > 200  # the pixels themselves, not scaled
    finally:
        trainer.close()
    flat = make("pettingzoo:test_adapter_envs:TinyEnv", num_envs=1, num_workers=0)
    try:
        assert not flat.byte_observations
    finally:
        flat.close()


def test_pictures_without_a_state_are_joined_along_their_channels() -> None:
    """No state(): the critic's global state is the agents' pictures stacked as channels,
    [8, 7, 2 x 3] in agent order, a picture the critic's convolutions read."""
    from test_adapter_envs import PictureEnv

    env = make("pettingzoo:test_adapter_envs:PictureEnv", num_envs=2, num_workers=0, stateless=True)
    try:
        assert env.spec.state_shape == (8, 7, 6)
        step = env.reset(seed=0)
        ref = PictureEnv()
        ref.reset()
        for i, agent in enumerate(ref.possible_agents):
            want = torch.from_numpy(ref.picture(agent)).float()
            torch.testing.assert_close(step.state[1, ..., 3 * i : 3 * i + 3], want)
        net = ActorCritic(env.spec, ModelConfig(encoder="cnn", cnn_kernels=[2]), AlgoConfig())
        assert net.critics["painter"].trunk.encoder.image == (6, 8, 7)
        step = env.step({"painter": torch.zeros(2, 2, 1, dtype=torch.long)})
        assert step.state.shape == (2, 8, 7, 6) and env.byte_observations
    finally:
        env.close()


def test_a_picture_saved_flat_by_an_older_run_is_the_same_input() -> None:
    """Runs trained before the adapters kept pictures' axes saved them flat: the same values
    in the same order, which their networks read flattened, so they still load."""
    from mappo.data import spec_difference, spec_to_dict

    spec = _grid_spec()
    saved = spec_to_dict(spec)
    saved["groups"]["agents"]["obs_shape"] = [13 * 13 * 3]
    saved["state_shape"] = [7 * 7 * 2]
    assert spec_difference(saved, spec) is None
    saved["groups"]["agents"]["obs_shape"] = [13 * 13 * 3 + 1]
    assert "observation shape (13, 13, 3) now" in spec_difference(saved, spec)


def test_flat_readers_of_a_picture_state_see_it_scaled() -> None:
    """QMIX's hypernetworks and COMA's critic read the state flat: with model.encoder=cnn a
    picture state comes in scaled as the convolutions see it, not as 0-255 pixels."""
    from mappo.nn.coma import ComaNetworks
    from mappo.nn.q_agents import QNetworks

    spec = _grid_spec()
    cnn = config_mod.load("grid/spread", {"algo.name": "qmix"})
    mlp = config_mod.load("grid/spread", {"algo.name": "qmix", "model.encoder": "mlp"})
    torch.manual_seed(0)
    nets = QNetworks(spec, cnn.model, cnn.algo)
    assert nets.state_scale == pytest.approx(1 / 255)
    assert QNetworks(spec, mlp.model, mlp.algo).state_scale == 1.0
    q, state = torch.randn(4, 3), torch.randint(0, 2, (4, 7, 7, 2)).float() * 255
    torch.testing.assert_close(nets.mix(q, state), nets.mixer(q, state.flatten(1) / 255))
    coma = config_mod.load("grid/spread", {"algo.name": "coma"})
    critic = ComaNetworks(spec, coma.model, coma.algo).critic
    obs = torch.full((1, 2, 3, 13, 13, 3), 255.0)
    x = critic.inputs(state[:2].unsqueeze(0), obs, torch.zeros(1, 2, 3, dtype=torch.long))
    assert float(x[..., : 7 * 7 * 2 + 13 * 13 * 3].max()) == pytest.approx(1.0)


def test_a_large_flat_state_is_warned_about_for_the_network_that_reads_it() -> None:
    import types

    from mappo.data import ActionSpec, EnvSpec, GroupSpec
    from mappo.trainer import _warn_large_observations

    group = GroupSpec(("a_0", "a_1"), (8,), ActionSpec((5,)))
    env = types.SimpleNamespace(spec=EnvSpec({"a": group}, state_shape=(20_000,), episode_limit=5))
    cases = [
        ({}, "the critic of .* reads 20,000 values .*algo.critic_input=local"),
        ({"algo.name": "qmix"}, "QMIX's hypernetworks .* read 20,000 values .*algo.name=vdn"),
        ({"algo.name": "coma"}, "COMA's critic .* read 20,000 values"),
    ]
    for overrides, message in cases:
        cfg = config_mod.load("mpe/simple_spread", overrides)
        with pytest.warns(UserWarning, match=message):
            _warn_large_observations(cfg, env)


def test_the_cnn_needs_a_convolution() -> None:
    with pytest.raises(ConfigError, match="'model.cnn_channels' is empty"):
        config_mod.load(
            "grid/spread",
            {"model.cnn_channels": [], "model.cnn_kernels": [], "model.cnn_strides": []},
        )


def test_convolutions_that_enlarge_a_small_picture_are_warned_about() -> None:
    from mappo.trainer import _warn_large_observations

    env = make("grid/spread", num_envs=1, size=20)  # [39, 39, 3]: 4,563 values
    cfg = config_mod.load("grid/spread", {"model.cnn_channels": [32]})  # 32 x 37 x 37 maps
    with pytest.warns(UserWarning, match="leave 43,808 values for the first dense layer"):
        _warn_large_observations(cfg, env)


def test_a_layout_that_reads_the_wrong_end_as_channels_is_warned_about() -> None:
    with pytest.warns(UserWarning, match="reads x of shape \\(8, 8, 3\\) as 8 channels"):
        assert image_layout((8, 8, 3), "chw", "x") == (8, 8, 3, False)


def test_networks_too_large_for_the_memory_are_refused_before_they_are_built(monkeypatch):
    import mappo.trainer as T

    # 600 MiB free: the rollout (about 260 MB) fits, the first layers (560 MB) do not
    monkeypatch.setattr(T, "available_bytes", lambda device: 600 * 2**20)
    cfg = config_mod.load(
        "grid/spread",
        {**QUICK, "env.kwargs": {"size": 60}, "model.cnn_channels": [32], "eval_episodes": 2},
    )
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="first dense layers would"):
        Trainer(cfg)


def test_an_adapter_env_s_rollout_is_checked_against_the_memory_once_made(monkeypatch):
    """Adapter envs with few copies are not probed before they are made (a probe starts an
    env); their pictures can still need more memory than is free: the trainer checks with
    the env it made, before the rollout is allocated."""
    import mappo.trainer as T

    monkeypatch.setattr(T, "available_bytes", lambda device: 512 * 2**10)  # 512 KiB free
    cfg = config_mod.load(
        "pettingzoo/simple_spread",
        {
            "env.name": "pettingzoo:test_adapter_envs:PictureEnv",
            "env.kwargs": {"num_workers": 0},
            "env.num_envs": 2,
            "rollout_length": 1000,
            "eval_episodes": 2,
            "model.hidden_sizes": [8, 8],
            **{k: v for k, v in QUICK.items() if k != "env.num_envs"},
        },
    )
    with pytest.raises(ConfigError, match="lower env.num_envs or rollout_length"):
        Trainer(cfg)


def test_a_policy_trained_in_this_process_evaluates_on_its_module(tmp_path) -> None:
    """The module a fresh run named counts as trusted in the process that trained it: its
    policy evaluates without --import (a saved run naming another module is still refused)."""
    run = train(
        "pettingzoo/simple_spread",
        _pictures(rollout_length=4, total_env_steps=8, run_dir=str(tmp_path)),
    )
    result = run.load_policy().evaluate(episodes=2, num_workers=0)
    assert result["eval_episodes"] == 2


def test_evaluations_longer_than_the_training_are_warned_about(tmp_path) -> None:
    from mappo.trainer import _warn_long_evaluations

    cfg = config_mod.load(
        "grid/spread", {"total_env_steps": 3 * 640, "eval_episodes": 100, "eval_interval": 2}
    )
    # 2 evaluations (after update 2 and the final one, after update 3) of 100 episodes of up
    # to 300 steps
    with pytest.warns(UserWarning, match="2 evaluation\\(s\\) .* may step 60,000 env steps"):
        _warn_long_evaluations(cfg, 300)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_long_evaluations(cfg, 20)  # 4,000 steps: not worth a word


def test_pictures_already_in_0_1_are_not_divided_by_255_silently() -> None:
    unit = {"num_workers": 0, "unit": True}
    cfg = config_mod.load("pettingzoo/simple_spread", _pictures(**{"env.kwargs": unit}))
    with pytest.warns(UserWarning, match="bounds its pictures by 1.*set model.image_scale=1"):
        Trainer(cfg).close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(config_mod.apply(cfg, {"model.image_scale": 1.0})).close()


def test_a_state_of_stacked_pictures_is_read_in_the_observations_layout() -> None:
    """Two [5, 10, 3] pictures stacked along their channels make a [5, 10, 6] state, which
    the sizes alone would read as channels first: the critic takes the observations' layout."""
    from mappo.data import ActionSpec, EnvSpec, GroupSpec
    from mappo.nn.actor_critic import picture_layout

    group = GroupSpec(("a_0", "a_1"), (5, 10, 3), ActionSpec((3,)))
    spec = EnvSpec({"a": group}, state_shape=(5, 10, 6), episode_limit=5)
    cfg = ModelConfig(encoder="cnn", cnn_kernels=[2], recurrent="none")
    assert picture_layout((5, 10, 6), spec, cfg) == "hwc"
    assert picture_layout((5, 10, 6), spec, ModelConfig(encoder="cnn", image_layout="chw")) == (
        "chw"
    )
    net = ActorCritic(spec, cfg, AlgoConfig())
    assert net.critics["a"].trunk.encoder.image == (6, 5, 10)
    # three agents: [8, 7, 9], which the sizes alone cannot tell
    group = GroupSpec(("a_0", "a_1", "a_2"), (8, 7, 3), ActionSpec((3,)))
    spec = EnvSpec({"a": group}, state_shape=(8, 7, 9), episode_limit=5)
    assert ActorCritic(spec, cfg, AlgoConfig()).critics["a"].trunk.encoder.image == (9, 8, 7)


def test_a_joined_state_saved_flat_holds_its_values_in_another_order() -> None:
    """The flat join of the agents' pictures that older runs saved is not the stacked
    picture state of now (the same values, another order): such a run is refused."""
    from mappo.data import ActionSpec, EnvSpec, GroupSpec, spec_difference, spec_to_dict

    group = GroupSpec(("a_0", "a_1"), (8, 7, 3), ActionSpec((3,)))
    spec = EnvSpec({"a": group}, state_shape=(8, 7, 6), episode_limit=5)
    saved = spec_to_dict(spec)
    saved["groups"]["a"]["obs_shape"] = [8 * 7 * 3]
    saved["state_shape"] = [8 * 7 * 6]
    assert "the global state has shape (8, 7, 6) now" in spec_difference(saved, spec)


def test_stacked_seeds_check_their_networks_against_the_memory_too(monkeypatch) -> None:
    import mappo.trainer as T

    # 1.5 GiB free: one seed's first layers (about 560 MB) fit, two seeds' do not
    monkeypatch.setattr(T, "available_bytes", lambda device: 1536 * 2**20)
    over = {**QUICK, "env.kwargs": {"size": 60}, "model.cnn_channels": [32], "eval_episodes": 2}
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="first dense layers would"):
        T.train_seeds("grid/spread", {**over, "num_seeds": 2})
