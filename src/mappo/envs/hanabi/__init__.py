"""Hanabi (the MAPPO paper's third benchmark), batched on a torch device.

Registered names (the Hanabi Learning Environment's variants): ``hanabi/full-2p`` ...
``hanabi/full-5p`` (5 colors x 5 ranks, 8 information tokens, 3 lives), ``hanabi/small-2p``
(2 colors, 2-card hands, 3 tokens, 1 life) and ``hanabi/very-small-2p`` (1 color). The rules
and the observation are the HLE's, checked move by move against OpenSpiel's ``hanabi`` game
(``tests/test_hanabi.py``); see :mod:`mappo.envs.hanabi.game` and :mod:`mappo.envs.hanabi.env`.
"""

from __future__ import annotations

import functools

from mappo.envs.hanabi.env import HanabiEnv
from mappo.envs.hanabi.game import HanabiGames, HanabiRules
from mappo.envs.registry import register

for _p in (2, 3, 4, 5):
    register(
        f"hanabi/full-{_p}p",
        functools.partial(HanabiEnv, players=_p),
        f"Hanabi, {_p} players, the full game (5 colors x 5 ranks, 8 tokens, 3 lives)",
    )
_SMALL = {"ranks": 5, "hand_size": 2, "max_information_tokens": 3, "max_life_tokens": 1}
register(
    "hanabi/small-2p",
    functools.partial(HanabiEnv, players=2, colors=2, **_SMALL),
    "Hanabi-Small, 2 players (2 colors x 5 ranks, 2-card hands, 3 tokens, 1 life)",
)
register(
    "hanabi/very-small-2p",
    functools.partial(HanabiEnv, players=2, colors=1, **_SMALL),
    "Hanabi-Very-Small, 2 players (1 color x 5 ranks, 2-card hands, 3 tokens, 1 life)",
)

__all__ = ["HanabiEnv", "HanabiGames", "HanabiRules"]
