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
