"""Google Research Football (the MAPPO paper's fourth benchmark) through the worker-process adapter.

Registered names, with the number of left-team players the agents control as in the MAPPO
paper's GRF experiments (Yu et al. 2022, Appendix, Table of GRF scenarios):

- ``football/academy_3_vs_1_with_keeper`` (3), ``football/academy_counterattack_easy`` (4),
  ``football/academy_counterattack_hard`` (4), ``football/academy_corner`` (10),
  ``football/academy_pass_and_shoot_with_keeper`` (2),
  ``football/academy_run_pass_and_shoot_with_keeper`` (2);
- the full game against GRF's built-in AI: ``football/11_vs_11_easy_stochastic``,
  ``football/11_vs_11_stochastic`` and ``football/11_vs_11_hard_stochastic`` (all 11 players);
- ``football:<scenario>`` for any other GRF scenario (set ``num_agents``).

Each copy is a :class:`~mappo.envs.football.grf.FootballParallelEnv` (observation, reward, state
and statistics are described there) stepped in worker processes; keyword arguments are those of
that class (``num_agents``, ``rewards``, ``share_reward``, ``render_width``) and the adapter's
options (``num_workers``, ``envs_per_worker``, ``timeout``...). GRF is a C++ game built from
source: ``docs/football.md`` has the commands.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

from mappo.envs.adapters.adapter import ParallelEnvAdapter, _split_kwargs
from mappo.envs.base import EnvError
from mappo.envs.registry import register, register_scheme

# Said where gfootball is missing; self-contained, since an installed wheel has neither the
# script nor the docs it names.
BUILD_HINT = (
    "it builds from source: install cmake and the SDL2, Boost and OpenGL headers, then `pip "
    "install psutil wheel setuptools && pip install --no-build-isolation --no-deps "
    "gfootball==2.10.2` and the football extra (`pip install 'mappo[football]'`); from the "
    "project's source, scripts/install_football.sh does all of it (docs/football.md explains it)"
)


SCENARIOS = {
    "academy_3_vs_1_with_keeper": (3, "3 attackers against a defender and the keeper"),
    "academy_counterattack_easy": (4, "4 attackers on a counterattack against 1 defender"),
    "academy_counterattack_hard": (4, "4 attackers on a counterattack against 2 defenders"),
    "academy_corner": (10, "a corner kick, 10 field players against 11"),
    "academy_pass_and_shoot_with_keeper": (2, "2 attackers pass and shoot past a defender"),
    "academy_run_pass_and_shoot_with_keeper": (
        2,
        "2 attackers run, pass and shoot past a defender",
    ),
    "11_vs_11_easy_stochastic": (11, "the full match against the easy built-in AI"),
    "11_vs_11_stochastic": (11, "the full match against the medium built-in AI"),
    "11_vs_11_hard_stochastic": (11, "the full match against the hard built-in AI"),
}
"""Registered scenario -> (players the agents control, description)."""

GRF_TARGET = "mappo.envs.football.grf:FootballParallelEnv"

GAME_BYTES = 60 * 2**20
"""Memory of one GRF game in its worker (56-58 MB measured with gfootball 2.10.2), so that the
trainer refuses a run whose games would not fit before it starts them."""


class FootballEnv(ParallelEnvAdapter):
    """``num_envs`` Google Research Football games stepped in worker processes.

    Args:
        scenario: the GRF scenario (a file of ``gfootball/scenarios``).
        num_envs, device, seed: as every batched env; game ``i`` is seeded from
            ``(seed, i)`` (the adapters' ``copy_seed``).
        num_agents: left-team players under the agents' control.
        env_kwargs: further arguments of :class:`~mappo.envs.football.grf.FootballParallelEnv`.
        options: the adapter's (:class:`~mappo.envs.adapters.ParallelEnvAdapter`).
    """

    def __init__(
        self,
        scenario: str,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        num_agents: int,
        env_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        name = options.pop("name", None) or f"football/{scenario}"
        if not (isinstance(num_agents, int) and not isinstance(num_agents, bool)) or not (
            1 <= num_agents <= 11
        ):
            raise EnvError(f"{name}: num_agents must be an integer in 1..11, got {num_agents!r}")
        spec = importlib.util.find_spec("gfootball")
        if spec is None:
            raise EnvError(
                f"{name} needs Google Research Football (the Python package 'gfootball'), which "
                f"is not installed; {BUILD_HINT}"
            )
        # GRF exits the process on an unknown scenario: check the name first, by its file (the
        # package is not imported here: it imports gym, which prints a notice).
        folders = [Path(p) / "scenarios" for p in spec.submodule_search_locations or ()]
        if not scenario.isidentifier() or not any(
            (folder / f"{scenario}.py").is_file() for folder in folders
        ):
            raise EnvError(
                f"{name}: GRF has no scenario {scenario!r}; the names are the files of "
                "gfootball/scenarios (e.g. academy_empty_goal_close, 11_vs_11_stochastic)"
            )
        kwargs = {"scenario": scenario, "num_agents": num_agents, **(env_kwargs or {})}
        # GRF reports its own time limit as a truncation; the adapter must not relabel a goal on
        # the last step as one.
        options.setdefault("truncate_at_limit", False)
        super().__init__(
            ("import", GRF_TARGET, kwargs), "parallel", num_envs, device, seed, name=name, **options
        )


def make_football(
    scenario: str,
    num_envs: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **kwargs: Any,
) -> FootballEnv:
    """Factory of the registered names and of the ``football:<scenario>`` scheme."""
    options, env_kwargs = _split_kwargs(kwargs)
    default = SCENARIOS.get(scenario, (None,))[0]
    num_agents = env_kwargs.pop("num_agents", default)
    if num_agents is None:
        raise EnvError(
            f"football:{scenario}: set num_agents=<players the agents control> for a scenario "
            "without a preset number"
        )
    name = f"football/{scenario}" if scenario in SCENARIOS else f"football:{scenario}"
    return FootballEnv(
        scenario,
        num_envs,
        device,
        seed,
        num_agents=num_agents,
        env_kwargs=env_kwargs,
        name=name,
        **options,
    )


for _scenario, (_n, _what) in SCENARIOS.items():
    register(
        f"football/{_scenario}",
        functools.partial(make_football, _scenario),
        f"Google Research Football: {_what} ({_n} agents)",
        workers=True,
        copy_bytes=GAME_BYTES,
    )
register_scheme("football", make_football, workers=True)

__all__ = ["SCENARIOS", "FootballEnv", "make_football"]
