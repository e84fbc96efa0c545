"""The MAPPO paper's Multi-Agent Particle Environments as batched tensor programs.

Registered names: ``mpe/simple_spread`` (Spread), ``mpe/simple_speaker_listener`` (Comm) and
``mpe/simple_reference`` (Reference). They follow the paper's own copy of the MPE step for step:
its shared (summed) rewards, its action signs and its reset ranges; episodes last 25 steps and end
by truncation.

Every scenario takes ``continuous_actions=True`` for mpe2's continuous action boxes (movement
``[no-op, -x, +x, -y, +y]`` in ``[0, 1]^5``, messages as ``dim_c`` numbers in ``[0, 1]``; see
:mod:`mappo.envs.mpe.core`), and ``physics="pettingzoo"`` / ``reward="pettingzoo"`` for mpe2's
integration order and rewards. ``mpe/simple_spread_continuous`` is ``mpe/simple_spread`` with
``continuous_actions=True``.
"""

from typing import Any

from mappo.envs.base import BatchedEnv, EnvError
from mappo.envs.mpe.core import ParticleEnv, StateField, WorldSpec
from mappo.envs.mpe.params import checked_factory
from mappo.envs.mpe.simple_reference import SimpleReference
from mappo.envs.mpe.simple_speaker_listener import SimpleSpeakerListener
from mappo.envs.mpe.simple_spread import SimpleSpread
from mappo.envs.registry import register

_spread = checked_factory(SimpleSpread)
register(
    "mpe/simple_spread",
    _spread,
    "Spread: N agents cover N landmarks without colliding (paper's MPE conventions)",
)


_spread_box = checked_factory(
    SimpleSpread, "mpe/simple_spread_continuous", {"continuous_actions": True}
)


def _spread_continuous(**kwargs: Any) -> BatchedEnv:
    """``mpe/simple_spread`` with ``continuous_actions=True`` (and its other parameters)."""
    if kwargs.pop("continuous_actions", True) is not True:
        raise EnvError(
            "mpe/simple_spread_continuous always has continuous actions; make "
            "'mpe/simple_spread' for discrete ones"
        )
    return _spread_box(**kwargs)


register(
    "mpe/simple_spread_continuous",
    _spread_continuous,
    "Spread with mpe2's continuous actions: a [0, 1]^5 force box per agent",
)
register(
    "mpe/simple_speaker_listener",
    checked_factory(SimpleSpeakerListener),
    "Comm: a static speaker guides a listener to one of 3 landmarks",
)
register(
    "mpe/simple_reference",
    checked_factory(SimpleReference),
    "Reference: 2 agents move and speak to send each other to their goal landmarks",
)

__all__ = [
    "ParticleEnv",
    "SimpleReference",
    "SimpleSpeakerListener",
    "SimpleSpread",
    "StateField",
    "WorldSpec",
]
