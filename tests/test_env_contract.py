"""The checks every batched env gets from the base class."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mappo.envs import ActionError, make
from mappo.envs.base import spec_from_dict, spec_to_dict

sys.path.insert(0, str(Path(__file__).parent))
from toy_env import MatchEnv  # noqa: E402


def test_step_refuses_actions_the_mask_forbids() -> None:
    env = MatchEnv(num_envs=3, masks=True, deaths=True)
    env.reset(seed=0)
    bad = torch.zeros(3, 2, 1, dtype=torch.long)
    bad[1, 0, 0] = 3  # action 3 is always masked
    with pytest.raises(ActionError, match="group 'agents' at \\(env, agent, head\\) \\(1, 0, 0\\)"):
        env.step({"agents": bad})
    ok = torch.zeros(3, 2, 1, dtype=torch.long)
    for _ in range(2):
        env.step({"agents": ok})
    # Agent 1 is dead now: anything but its no-op (action 0) is refused.
    dead = ok.clone()
    dead[0, 1, 0] = 1
    with pytest.raises(ActionError, match="not allowed by its action mask"):
        env.step({"agents": dead})
    env.validate_actions = False  # the trainer's hot loop: no checks
    env.step({"agents": dead})


def test_set_state_masks_are_checked_too() -> None:
    env = MatchEnv(num_envs=2, masks=True)
    env.reset(seed=0)
    env.set_state(env.get_state())
    with pytest.raises(ActionError):
        env.step({"agents": torch.full((2, 2, 1), 3, dtype=torch.long)})


@pytest.mark.parametrize(
    ("actions", "message"),
    [
        (
            {"agents": torch.zeros(4, 3, dtype=torch.long)},
            "shape \\(4, 3, 1\\), expected \\(2, 3, 1\\)",
        ),
        ({"agents": torch.zeros(2, 3, 1)}, "dtype torch.float32, expected an integer"),
        ({"agents": torch.full((2, 3, 1), 5)}, "out of range; head sizes are \\(5,\\)"),
        ({"agents": torch.full((2, 3, 1), -1)}, "out of range"),
        ({"others": torch.zeros(2, 3, 1, dtype=torch.long)}, "do not match the env's groups"),
        ([1, 2, 3], "must be a dict"),
    ],
)
def test_malformed_actions_name_the_group(actions, message) -> None:
    env = make("mpe/simple_spread", num_envs=2)
    env.reset(seed=0)
    with pytest.raises(ActionError, match=message):
        env.step(actions)


def test_spec_round_trips_through_a_plain_dict() -> None:
    for name in ("mpe/simple_spread", "mpe/simple_speaker_listener", "mpe/simple_reference"):
        spec = make(name).spec
        assert spec_from_dict(spec_to_dict(spec)) == spec
    assert (
        spec_from_dict(spec_to_dict(MatchEnv(1, masks=True).spec)) == MatchEnv(1, masks=True).spec
    )


def test_a_final_state_given_as_a_function_is_made_once_when_read() -> None:
    """``EnvStep.final_state`` may be given as a function (an env's deferred copy): nothing runs
    until the field is read, reading gives its tensor, and a second read the same one; a tensor
    given directly comes back as it is, and copies of the record read through it."""
    import dataclasses

    from mappo.data import EnvStep

    calls = []

    def make_state() -> torch.Tensor:
        calls.append(1)
        return torch.full((2, 3), 7.0)

    x = torch.zeros(2, 3)
    fields = {
        "obs": {"a": x},
        "state": x,
        "reward": {"a": x},
        "terminated": x[:, 0] > 0,
        "truncated": x[:, 0] > 0,
        "alive": {"a": x > -1},
    }
    step = EnvStep(**fields, final_state=make_state)
    assert calls == []
    first = step.final_state
    assert calls == [1] and torch.equal(first, torch.full((2, 3), 7.0))
    assert step.final_state is first and calls == [1]
    copy = dataclasses.replace(step, state=x + 1)
    assert copy.final_state is first and calls == [1]
    assert EnvStep(**fields, final_state=x).final_state is x
    assert EnvStep(**fields).final_state is None

    # Stacked seeds concatenate their envs' steps: the final states stay unread until asked for.
    from mappo.learners.seeds import cat_steps

    calls.clear()
    both = cat_steps([EnvStep(**fields, final_state=make_state) for _ in range(2)])
    assert calls == [] and torch.equal(both.state, torch.cat([x, x]))
    assert torch.equal(both.final_state, torch.full((4, 3), 7.0)) and calls == [1, 1]
    assert cat_steps([EnvStep(**fields, final_state=x)] * 2).final_state.shape == (4, 3)
    assert cat_steps([EnvStep(**fields)] * 2).final_state is None


class _Broken(MatchEnv):
    """MatchEnv with one mistake in what its step returns (``fault``)."""

    def __init__(self, fault: str) -> None:
        super().__init__(4, masks=True)
        self.fault = fault

    def _step(self, actions):  # noqa: ANN001, ANN202
        out = super()._step(actions)
        obs, mask = out.obs["agents"], out.action_mask["agents"]
        if self.fault == "none":
            return None
        if self.fault == "obs_shape":
            out.obs = {"agents": torch.cat([obs, obs[..., :1]], -1)}
        elif self.fault == "obs_float64":
            out.obs = {"agents": obs.double()}
        elif self.fault == "reward_nan":
            out.reward = {"agents": out.reward["agents"] * float("nan")}
        elif self.fault == "reward_shape":
            out.reward = {"agents": out.reward["agents"][:, 0]}
        elif self.fault == "done_float":
            out.terminated = out.terminated.float()
        elif self.fault == "group":
            out.obs = {"players": obs}
        elif self.fault == "mask_none":
            out.action_mask = {"agents": torch.zeros_like(mask)}
        elif self.fault == "stat_missing":
            out.stats = {}
        elif self.fault == "stat_shape":
            out.stats = {**out.stats, "accuracy": out.stats["accuracy"][:2]}
        elif self.fault == "agent_terminated_missing":
            self.agent_terminations = True  # promised, but the step has none
        elif self.fault == "mask_unknown":
            out.action_mask = {**out.action_mask, "agnts": mask}
        elif self.fault == "mask_not_dict":
            out.action_mask = None
        elif self.fault == "mask_undeclared":
            import dataclasses

            group = dataclasses.replace(self.spec.groups["agents"], has_action_mask=False)
            self.spec = dataclasses.replace(self.spec, groups={"agents": group})
        return out


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("none", "step\\(\\) must return an EnvStep, got NoneType"),
        ("obs_shape", "obs\\['agents'\\] has shape \\[4, 2, 6\\], the spec asks for \\[4, 2, 5\\]"),
        ("obs_float64", "obs\\['agents'\\] has dtype torch.float64, expected float32"),
        ("reward_nan", "reward\\['agents'\\] holds NaN or inf"),
        ("reward_shape", "reward\\['agents'\\] has shape \\[4\\]"),
        ("done_float", "terminated has dtype torch.float32, expected bool"),
        ("group", "obs has the groups \\['players'\\], the spec's are \\['agents'\\]"),
        ("mask_none", "action_mask\\['agents'\\] allows no action for alive agent 0 of env 0"),
        ("stat_missing", "stats has no 'accuracy', which spec.stat_names lists; return it from"),
        ("stat_shape", "stats\\['accuracy'\\] has shape \\[2\\], the spec asks for \\[4\\]"),
        ("agent_terminated_missing", "agent_terminated has no 'agents', which the env's"),
        # sampled with the mask, the loss would score the actions without it
        ("mask_undeclared", "action_mask has group 'agents', whose spec does not say has_act"),
        ("mask_unknown", "action_mask has group 'agnts', which the spec does not have \\(its"),
        (
            "mask_not_dict",
            "action_mask must be a dict of masks per group \\(empty for none\\), got",
        ),
    ],
)
def test_a_users_env_is_checked_on_its_first_outputs(fault, message):
    from mappo.envs.base import OUTPUT_CHECKS, EnvError

    env = _Broken(fault)
    step = env.reset(seed=0)
    actions = {"agents": torch.zeros(4, 2, 1, dtype=torch.int64)}
    env.validate_actions = False
    with pytest.raises(EnvError, match=message) as raised:
        env.step(actions)
    assert str(raised.value).startswith("toy/match: step()")  # names the env and the call
    # a sound env of the same kind passes, and after the first outputs nothing is checked
    sound = _Broken("ok")
    step = sound.reset(seed=0)
    for _ in range(OUTPUT_CHECKS + 2):
        step = sound.step(actions)
    assert sound.__dict__["_outputs_checked"] == OUTPUT_CHECKS and step.obs["agents"].shape[0] == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"obs_shape": 5},
            "groups\\['agents'\\].obs_shape must be a tuple of positive whole numbers",
        ),
        (
            {"obs_shape": (2.5,)},
            "obs_shape must be a tuple of positive whole numbers, e.g. \\(4,\\)",
        ),
        ({"agents": ()}, "group 'agents' needs at least one agent"),
        ({"state_shape": (0,)}, "state_shape must be a tuple of positive whole numbers"),
        ({"episode_limit": None}, "episode_limit must be a positive whole number of steps"),
        (
            {"stat_names": "hits"},
            "stat_names must be a tuple of names, e.g. \\('hits',\\), got 'hits'",
        ),
        ({"groups": {}}, "groups must be a dict of at least one GroupSpec"),
        ({"group_name": "red.team"}, "group name 'red.team' must be a non-empty name without"),
        ({"group_name": ""}, "group name '' must be a non-empty name without '.' and not"),
        ({"group_name": "items"}, "group name 'items' must .* not one of torch's module attr"),
        ({"agents": ("a", "a")}, "agent name 'a' appears twice in group 'agents'; give every"),
        ({"second_group": ("agent_0",)}, "'agent_0' appears in groups 'agents' and 'more'"),
    ],
)
def test_a_users_spec_is_checked_when_the_env_is_made(change, message):
    """A hand-written spec's slips are named before any network is built from it (they were
    tracebacks inside the networks, or silently wrong statistics)."""
    import dataclasses

    from mappo.envs import EnvError, make, register

    class Slipped(MatchEnv):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            group = self.spec.groups["agents"]
            group_keys = {k: v for k, v in change.items() if k in ("obs_shape", "agents")}
            groups = {change.get("group_name", "agents"): dataclasses.replace(group, **group_keys)}
            if "second_group" in change:
                groups["more"] = dataclasses.replace(group, agents=change["second_group"])
            spec_keys = {
                k: v
                for k, v in change.items()
                if k not in group_keys and k not in ("group_name", "second_group")
            }
            self.spec = dataclasses.replace(self.spec, **{"groups": groups, **spec_keys})

    register("toy/slipped", Slipped)
    with pytest.raises(EnvError, match="^toy/match: spec: .*" + message):
        make("toy/slipped", num_envs=2)


def test_a_subclass_reset_that_reworks_its_parent_s_is_checked_once() -> None:
    """A subclass that adds a feature to ``super().reset()``'s observations is checked against
    its own spec on the outer result only (the parent's intermediate was refused)."""
    import dataclasses

    class WithBias(MatchEnv):
        def __init__(self, num_envs: int) -> None:
            super().__init__(num_envs)
            group = self.spec.groups["agents"]
            wider = dataclasses.replace(group, obs_shape=(group.obs_shape[0] + 1,))
            self.spec = dataclasses.replace(self.spec, groups={"agents": wider})

        def reset(self, seed=None):  # noqa: ANN001, ANN201
            step = super().reset(seed)
            obs = step.obs["agents"]
            return dataclasses.replace(
                step, obs={"agents": torch.cat([obs, torch.ones_like(obs[..., :1])], -1)}
            )

    env = WithBias(3)
    assert env.reset(seed=0).obs["agents"].shape == (3, 2, 6)
    assert env.__dict__["_outputs_checked"] == 1  # the outer call's output alone
