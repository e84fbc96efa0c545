"""The MAPPO paper's Multi-Agent Particle Environments as batched tensor programs.

Registered names: ``mpe/simple_spread`` (Spread), ``mpe/simple_speaker_listener`` (Comm) and
``mpe/simple_reference`` (Reference). They follow the paper's own copy of the MPE step for step:
its shared (summed) rewards, its action signs and its reset ranges; episodes last 25 steps and end
by truncation.
"""

from mappo.envs.mpe.core import ParticleEnv, StateField, WorldSpec
from mappo.envs.mpe.params import checked_factory
from mappo.envs.mpe.simple_reference import SimpleReference
from mappo.envs.mpe.simple_speaker_listener import SimpleSpeakerListener
from mappo.envs.mpe.simple_spread import SimpleSpread
from mappo.envs.registry import register

register(
    "mpe/simple_spread",
    checked_factory(SimpleSpread),
    "Spread: N agents cover N landmarks without colliding (paper's MPE conventions)",
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
