"""Config: presets, overrides, and the errors a user sees for bad keys and values."""

from __future__ import annotations

import pytest

from mappo import config as C


def test_every_preset_loads_and_validates() -> None:
    presets = C.list_presets()
    assert "mpe/simple_spread" in presets and "mpe/simple_spread_fast" in presets
    for name in presets:
        cfg = C.load(name)
        assert cfg.env.name and cfg.total_env_steps > 0


def test_paper_settings_of_spread_preset() -> None:
    cfg = C.load("mpe/simple_spread")
    assert (cfg.env.num_envs, cfg.rollout_length) == (128, 25)
    assert (cfg.algo.epochs, cfg.algo.num_minibatches) == (10, 1)
    assert cfg.model.activation == "tanh" and cfg.model.recurrent == "gru"
    assert cfg.algo.value_loss == "huber" and cfg.algo.huber_delta == 10.0
    assert cfg.algo_name == "rmappo"
    assert C.load("mpe/simple_spread_mappo").algo_name == "mappo"
    assert C.load("mpe/simple_spread_ippo").algo_name == "rippo"


def test_feed_forward_fast_preset_gives_both_networks_the_clock() -> None:
    """``mpe/simple_spread_ff_fast`` is the fast preset without the GRU and with the particle
    world's time feature: the actor sees 18 + 1 inputs and the critic the state's 54 + 1."""
    from mappo.trainer import Trainer

    cfg = C.load("mpe/simple_spread_ff_fast", ["env.num_envs=4", "compile=off"])
    assert cfg.model.recurrent == "none" and cfg.env.kwargs == {"time_feature": True}
    assert (cfg.algo.epochs, cfg.algo.num_minibatches) == (5, 2)
    trainer = Trainer(cfg)
    try:
        policy = trainer.learner.policy
        first = next(p for p in policy.actors["agents"].parameters() if p.dim() == 3)
        assert trainer.env.spec.groups["agents"].obs_shape == (19,)
        assert first.shape[1] == 19  # [copies, in, out]
        assert policy.critics["agents"].in_features == 55
        trainer.iterate()
        assert trainer.env_steps == 4 * cfg.rollout_length
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("preset", "critic_in", "critic_width", "chunk"),
    [
        ("smac/3m_cleanmarl_ippo_rnn", "local", 32, 5),
        ("smac/3m_cleanmarl_mappo_rnn", "state", 64, 10),
    ],
)
def test_cleanmarls_recurrent_presets_build_its_networks(preset, critic_in, critic_width, chunk):
    """CleanMARL's ``ippo_lstm.py`` / ``mappo_lstm.py``: a 32-unit ReLU layer and a 32-unit GRU
    in the actor, a feed-forward critic of two ReLU layers (32 wide on the agent's observation,
    64 on the state), chunks of 5 / 10 steps; the rest as the feed-forward CleanMARL presets."""
    from mappo.trainer import Trainer

    cfg = C.load(preset, ["compile=off"])
    assert (cfg.algo.critic_input, cfg.algo.data_chunk_length) == (critic_in, chunk)
    assert (cfg.algo.actor_lr, cfg.algo.critic_lr, cfg.algo.epochs) == (8e-4, 8e-4, 3)
    trainer = Trainer(cfg)
    try:
        policy = trainer.learner.policy
        (actor,), (critic,) = policy.actors.values(), policy.critics.values()
        assert actor.state_size > 0 and critic.state_size == 0
        widths = [p.shape[-1] for n, p in critic.named_parameters() if n.endswith("weight")]
        assert widths[:2] == [critic_width, critic_width]
        assert [p.shape[-1] for n, p in actor.trunk.mlp.named_parameters() if "weight" in n] == [32]
        trainer.iterate()
        assert trainer.env_steps == cfg.env.num_envs * cfg.rollout_length
    finally:
        trainer.close()


def test_overrides_dotted_and_bare() -> None:
    cfg = C.load("mpe/simple_spread", ["algo.epochs=3", "actor_lr=1e-3", "hidden_sizes=[32,32]"])
    assert cfg.algo.epochs == 3
    assert cfg.algo.actor_lr == pytest.approx(1e-3)
    assert cfg.model.hidden_sizes == [32, 32]
    cfg = C.load(None, {"env": {"name": "mpe/simple_reference"}, "seed": 3})
    assert cfg.env.name == "mpe/simple_reference" and cfg.seed == 3


def test_one_env_kwarg_keeps_the_presets_others() -> None:
    cfg = C.load("pettingzoo/simple_spread", ["env.kwargs.num_workers=2"])
    assert cfg.env.kwargs == {"num_workers": 2, "N": 3, "max_cycles": 25}
    cfg = C.load("pettingzoo/simple_spread", ["env.kwargs={N: 4}"])
    assert cfg.env.kwargs == {"N": 4}  # the whole mapping replaces the preset's
    with pytest.raises(C.ConfigError, match="one keyword argument"):
        C.load("mpe/simple_spread", ["env.kwargs.a.b=1"])


def test_another_env_gets_only_the_kwargs_of_the_overrides(tmp_path) -> None:
    # The feed-forward preset's time_feature is an argument of the particle world: a PettingZoo
    # env named in its place refused it ("unexpected keyword argument 'time_feature'").
    cfg = C.load("mpe/simple_spread_ff_fast", ["env.name=pettingzoo:mpe2.simple_adversary_v3"])
    assert cfg.env.kwargs == {} and cfg.model.recurrent == "none"  # the settings stay
    swap = ["env.name=python:my_envs:Mine", "env.kwargs.n_agents=2"]
    assert C.load("vmas/balance", swap).env.kwargs == {"n_agents": 2}
    swap = {"env": {"name": "vmas/navigation", "kwargs": {"n_agents": 2}}}
    assert C.load("vmas/balance", swap).env.kwargs == {"n_agents": 2}  # replaced as a whole
    # Another env of the same family takes the same parameters: the preset's stay.
    cfg = C.load("smac/3s5z_fast", ["env.name=smac/MMM"])
    kwargs = {"regeneration_reward": False, "obs_last_action": False, "obs_agent_id": False}
    kwargs["agent_state"] = "as"
    assert cfg.env.kwargs == kwargs and cfg.preset == ""
    cfg = C.load("vmas/balance", ["env.name=vmas/balance", "env.kwargs.n_agents=2"])
    assert cfg.env.kwargs["package_mass"] == 5 and cfg.env.kwargs["n_agents"] == 2
    # the bare name of env.kwargs, a YAML file over a preset, the adapters' worker options
    swap = ["env.name=pettingzoo:mpe2.simple_spread_v3", "kwargs={max_cycles: 30}"]
    assert C.load("mpe/simple_spread_ff_fast", swap).env.kwargs == {"max_cycles": 30}
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "base: mpe/simple_spread_ff_fast\nenv:\n  name: pettingzoo:mpe2.simple_tag_v3\n"
    )
    assert C.load(str(mine)).env.kwargs == {}
    swap = ["env.name=gymnasium:rware:rware-tiny-2ag-v2"]
    assert C.load("lbf/8x8-2p-2f-coop_qmix", swap).env.kwargs == {"num_workers": 0}
    # A saved run's config is opened as it was written (checks added since do not lock it out).
    assert C.from_dict({"algo": {"name": "vdn", "mixing_embed_dim": 64}}).algo.name == "vdn"
    names = ("smac/3m", "gymnasium:lbforaging:F-v3", "python:m:C", "vmas/balance")
    assert [C.env_family(n) for n in names] == [
        "smac",
        "gymnasium:lbforaging",
        "python:m",
        "vmas/balance",  # each scenario its own parameters
    ]
    assert C.load("vmas/balance", ["env.name=vmas/navigation"]).env.kwargs == {}


def test_unknown_key_names_nearest_valid_key() -> None:
    with pytest.raises(C.ConfigError, match="unknown config key 'algo.epoch'.*'algo.epochs'"):
        C.load("mpe/simple_spread", ["algo.epoch=3"])
    with pytest.raises(C.ConfigError, match="did you mean 'algo.entropy_coef'"):
        C.load(None, ["entropy_coeff=0.1"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.epochs=two", "'algo.epochs' must be an integer"),
        ("algo.epochs=0", "'algo.epochs' must be >= 1"),
        ("algo.gamma=1.5", "'algo.gamma' must be <= 1"),
        ("algo.clip=0", "'algo.clip' must be > 0"),
        ("model.activation=gelu", "'model.activation' must be one of"),
        ("model.hidden_sizes=64", "'model.hidden_sizes' must be a list"),
        ("model.share_params=maybe", "'model.share_params' must be true or false"),
        ("algo.critic_input=global", "'algo.critic_input' must be one of"),
        ("device=tpu", "'device' must be 'cpu', 'cuda'"),
        ("algo.num_minibatches=100000", "exceeds the 320 chunks of algo.data_chunk_length=10"),
        ("epochs", "must look like KEY=VALUE"),
    ],
)
def test_bad_values_name_the_field(override: str, message: str) -> None:
    with pytest.raises(C.ConfigError, match=message):
        C.load("mpe/simple_spread", [override])


def test_yaml_file_with_base(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("base: mpe/simple_spread\nalgo:\n  epochs: 4\nseed: 7\n")
    cfg = C.load(str(path))
    assert cfg.algo.epochs == 4 and cfg.seed == 7 and cfg.env.num_envs == 128
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  epochs: 4\n  clip_eps: 0.3\n")
    with pytest.raises(C.ConfigError, match=r"unknown config key 'algo.clip_eps'.*bad.yaml"):
        C.load(str(bad))


def test_missing_file_and_preset() -> None:
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load("nowhere/missing.yaml")
    with pytest.raises(C.ConfigError, match="did you mean 'mpe/simple_spread'"):
        C.load("mpe/simple_sprad")


def test_yaml_never_runs_code(tmp_path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("seed: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        C.load(str(path))


def test_saved_config_round_trips(tmp_path) -> None:
    cfg = C.load("mpe/simple_reference", ["seed=5"])
    C.save(cfg, tmp_path / "config.yaml")
    again = C.load(str(tmp_path / "config.yaml"))
    assert C.to_dict(again) == C.to_dict(cfg)
    # Strings that read as numbers are written quoted (a run named "1e3" reads back its name).
    cfg = C.load("mpe/simple_spread", ['name="1e3"', 'env.kwargs.tag="1e-3"', 'env.kwargs.z="010"'])
    C.save(cfg, tmp_path / "config.yaml")
    again = C.load(str(tmp_path / "config.yaml"))
    assert again.name == "1e3" and again.env.kwargs == {"tag": "1e-3", "z": "010"}


def test_every_preset_s_saved_config_trains_again(tmp_path) -> None:
    # A run's config.yaml is a config of its own (mappo train RUN/config.yaml seed=2): it names
    # every key, which the check of the user's unread settings must not take for settings.
    for name in C.list_presets():
        cfg = C.load(name)
        C.save(cfg, tmp_path / "config.yaml")
        again = C.load(str(tmp_path / "config.yaml"), ["seed=2"])
        assert C.to_dict(again) == {**C.to_dict(cfg), "seed": 2}, name


def test_a_saved_run_whose_overrides_left_a_preset_setting_unread_trains_again(tmp_path) -> None:
    # The preset's 128-step chunks are unread once the run turns the GRU off: the preset's
    # setting, not the user's; a value other than the preset's in that file is the user's.
    cfg = C.load("mpe/simple_spread_jaxmarl_rnn", ["model.recurrent=none"])
    C.save(cfg, tmp_path / "config.yaml")
    assert C.to_dict(C.load(str(tmp_path / "config.yaml"))) == C.to_dict(cfg)
    text = (tmp_path / "config.yaml").read_text()
    (tmp_path / "mine.yaml").write_text(
        text.replace("data_chunk_length: 128", "data_chunk_length: 64")
    )
    with pytest.raises(C.ConfigError, match=r"'algo.data_chunk_length' cuts .*mine.yaml"):
        C.load(str(tmp_path / "mine.yaml"))


def test_a_setting_a_users_file_makes_that_the_run_never_reads_is_refused(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("base: mpe/simple_spread_qmix\nalgo:\n  n_step: 5\n")
    with pytest.raises(C.ConfigError, match=r"'algo.n_step' is read with .* \(in .*mine.yaml\)"):
        C.load(str(path))
    path.write_text("base: mpe/simple_spread\nalgo:\n  name: qmix\n")  # its defaults are fine
    assert C.load(str(path)).algo.name == "qmix"
    path.write_text("base: mpe/simple_spread_fast\nmodel:\n  recurrent: none\n")
    assert C.load(str(path)).model.recurrent == "none"  # (the preset's chunk length is not)


def test_a_base_path_is_read_beside_the_file_that_names_it(tmp_path, monkeypatch) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yaml").write_text("base: mpe/simple_spread_fast\nalgo:\n  clip: 0.1\n")
    (tmp_path / "sub" / "a.yaml").write_text("base: mpe/simple_spread_fast\nalgo:\n  clip: 0.3\n")
    (tmp_path / "sub" / "c.yaml").write_text("base: a.yaml\n")
    (tmp_path / "sub" / "d.yaml").write_text("base: ../a.yaml\n")
    monkeypatch.chdir(tmp_path)  # where a same-named file would have been read instead
    assert C.load("sub/c.yaml").algo.clip == 0.3 and C.load("sub/d.yaml").algo.clip == 0.1


def test_a_file_that_changes_the_env_of_a_saved_run_is_not_that_run_s_preset(tmp_path) -> None:
    C.save(C.load("mpe/simple_spread"), tmp_path / "config.yaml")
    path = tmp_path / "ref.yaml"
    path.write_text(f"base: {tmp_path / 'config.yaml'}\nenv:\n  name: mpe/simple_reference\n")
    assert C.load(str(path)).preset == ""
    assert C.load(str(tmp_path / "config.yaml")).preset == "mpe/simple_spread"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.value_loss=mse", "algo.huber_delta=2"], "'algo.huber_delta' is the Huber loss's"),
        (["algo.clip_value_loss=false", "algo.value_clip=0.1"], "'algo.value_clip' clips the"),
        (["model.recurrent=none", "algo.data_chunk_length=5"], "'algo.data_chunk_length' cuts"),
    ],
)
def test_mappo_settings_that_another_setting_leaves_unread_are_refused(overrides, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load("mpe/simple_spread", overrides)
    assert C.load("mpe/simple_spread", overrides[1:])  # read where the other one is not given


def test_integers_read_as_decimal_even_zero_padded() -> None:
    # YAML 1.1 read 010 as octal 8 (zero-padded seeds repeated) and 1:00 as 60.
    cfg = C.load("mpe/simple_spread", ["seed=010", "model.hidden_sizes=[064, 064]"])
    assert cfg.seed == 10 and cfg.model.hidden_sizes == [64, 64]
    assert [C.yaml_value(t) for t in ("008", "0x1f", "0o17", "-5", "1_000", "1:00")] == [
        8, 31, 15, -5, 1000, "1:00"
    ]  # fmt: skip


def test_describe_keys_documents_every_field() -> None:
    lines = C.describe_keys().splitlines()
    for key in C.LEAF_KEYS:
        assert sum(line.startswith(f"{key} = ") for line in lines) == 1
    assert all(f.metadata["doc"] for f in C.LEAF_KEYS.values())


def test_a_config_remembers_its_preset_unless_the_env_changes(tmp_path) -> None:
    assert C.load("mpe/simple_spread_fast").preset == "mpe/simple_spread_fast"
    assert C.load("mpe/simple_spread_fast", ["seed=3"]).preset == "mpe/simple_spread_fast"
    # The preset used as a template for another env: the run is named after the env instead.
    assert C.load("mpe/simple_spread", ["env.name=mpe/simple_reference"]).preset == ""
    path = tmp_path / "mine.yaml"
    path.write_text("base: mpe/simple_spread_fast\nseed: 2\n")
    assert C.load(str(path)).preset == ""


def test_numbers_with_an_exponent_are_numbers_everywhere(tmp_path):
    """YAML 1.1 (PyYAML) reads 1e-3 and 5e-1 as strings; typed fields converted them, but
    env.kwargs passed them to the env as text. Configs read them as YAML 1.2 does."""
    cfg = C.load(
        "mpe/simple_spread",
        ["env.kwargs.local_ratio=5e-1", "env.kwargs.reward=pettingzoo", "algo.actor_lr=1e-3"],
    )
    assert cfg.env.kwargs["local_ratio"] == 0.5 and cfg.algo.actor_lr == 0.001
    path = tmp_path / "c.yaml"
    path.write_text("base: mpe/simple_spread\nenv:\n  kwargs: {local_ratio: 2.5e-1, n: 1e3}\n")
    assert C.load(str(path)).env.kwargs == {"local_ratio": 0.25, "n": 1000.0}
    assert [C.yaml_value(t) for t in ("-1e30", ".5e3", "1.5E3", "1e", "e5", "1.2.3")] == [
        -1e30,
        500.0,
        1500.0,
        "1e",
        "e5",
        "1.2.3",
    ]


def test_a_files_env_kwargs_merge_with_its_base_s(tmp_path) -> None:
    # As the file's other sections do: the feed-forward preset keeps its time feature.
    path = tmp_path / "four.yaml"
    path.write_text("base: mpe/simple_spread_ff_fast\nenv:\n  kwargs:\n    num_agents: 4\n")
    assert C.load(str(path)).env.kwargs == {"time_feature": True, "num_agents": 4}
    path.write_text("base: mpe/simple_spread_ff_fast\nenv.kwargs: {num_agents: 4}\n")
    assert C.load(str(path)).env.kwargs == {"num_agents": 4}  # dotted: replaces them all


def test_one_key_under_two_spellings_is_refused(tmp_path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text("base: mpe/simple_spread_fast\nalgo:\n  clip: 0.1\nalgo.clip: 0.3\n")
    with pytest.raises(C.ConfigError, match=r"'algo.clip' is set twice; keep one \(in "):
        C.load(str(path))
    path.write_text("base: mpe/simple_spread_fast\nclip: 0.3\nalgo:\n  clip: 0.1\n")
    with pytest.raises(C.ConfigError, match=r"'algo.clip' is set twice \(as 'clip' and 'algo"):
        C.load(str(path))
    with pytest.raises(C.ConfigError, match="set twice"):
        C.load("mpe/simple_spread_fast", ["clip=0.1", "algo.clip=0.3"])


def test_an_empty_file_a_shared_base_and_an_algorithm_as_label_are_refused(tmp_path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# only a comment\n")
    with pytest.raises(C.ConfigError, match="sets nothing; give it a 'base: <preset>'"):
        C.load(str(empty))
    alias = tmp_path / "alias.yaml"
    alias.write_text("base: mpe/simple_spread_fast\n")  # a file that only names its base is fine
    assert C.load(str(alias)).env.name == "mpe/simple_spread"
    with pytest.raises(C.ConfigError, match="'_pymarl' is a base shared by presets"):
        C.load("_pymarl")
    derived = tmp_path / "derived.yaml"
    derived.write_text("base: _pymarl\nenv:\n  name: mpe/simple_spread\n")
    assert C.load(str(derived)).algo.name == "qmix"  # as a base it still serves
    with pytest.raises(C.ConfigError, match="to train qmix set algo.name=qmix"):
        C.check(C.load("mpe/simple_spread_fast", ["name=qmix"]))
    C.check(C.load("mpe/simple_spread_fast", ["name=mappo"]))
    C.check(C.load("mpe/simple_spread_fast", ["name=my_mappo"]))
    # a run saved before the check still opens
    assert C.from_dict({"name": "qmix"}).name == "qmix"
    # a missing file of one's own named like a base is named as missing
    with pytest.raises(C.ConfigError, match="config file 'configs/_mine.yaml' does not exist"):
        C.load("configs/_mine.yaml")


def test_an_env_without_a_preset_names_its_familys_preset():
    """``mappo train hanabi/full-3p`` (an env, no preset of its own) says how to train it,
    where a near preset name was offered (full-2p), which is another task."""
    with pytest.raises(C.ConfigError, match="mappo train hanabi/full-2p env.name=hanabi/full-3p"):
        C.load("hanabi/full-3p")
    with pytest.raises(C.ConfigError, match="did you mean 'hanabi/full-2p'"):
        C.load("hanabi/ful-2p")
