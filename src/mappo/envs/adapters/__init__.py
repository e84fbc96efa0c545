"""Environments the project did not write, as batched envs: PettingZoo and Gymnasium adapters.

Config names (registered here, resolved by :func:`mappo.envs.make`):

- ``pettingzoo:<module>`` calls ``<module>.parallel_env(**kwargs)``, e.g.
  ``pettingzoo:mpe2.simple_spread_v3``; ``pettingzoo:<module>:<callable>`` calls that callable;
- ``gymnasium:<package>:<env id>`` imports the package (which registers its ids) and calls
  ``gymnasium.make(id, **kwargs)``, e.g. ``gymnasium:lbforaging:Foraging-8x8-2p-2f-v3``.

Keyword arguments that name an adapter option (``num_workers``, ``groups``, ``timeout``...; see
:data:`ADAPTER_OPTIONS`) configure the adapter; the others go to the environment.
"""

from mappo.envs.adapters.adapter import (
    ADAPTER_OPTIONS,
    GymnasiumAdapter,
    ParallelEnvAdapter,
    PettingZooAdapter,
    make_gymnasium,
    make_pettingzoo,
)
from mappo.envs.adapters.pool import EnvOutputError, EnvWorkerError
from mappo.envs.registry import register_scheme

register_scheme("pettingzoo", make_pettingzoo, workers=True)
register_scheme("gymnasium", make_gymnasium, workers=True)

__all__ = [
    "ADAPTER_OPTIONS",
    "EnvOutputError",
    "EnvWorkerError",
    "GymnasiumAdapter",
    "ParallelEnvAdapter",
    "PettingZooAdapter",
    "make_gymnasium",
    "make_pettingzoo",
]
