"""Hanabi as a batched env: turn-based play in the batched contract.

Every step, in every game, only the player to act moves; the other players' actions are ignored,
they are not ``alive`` for that step (so the trainer leaves them out of the policy and value
losses, as the MAPPO paper does with its active masks) and their action mask allows only move 0
(the contract's convention for an agent that does not act). Every player is rewarded the change
of the score. Observations are each player's canonical HLE observation
(:meth:`~mappo.envs.hanabi.game.HanabiGames.observe`); with ``observation="paper"``, the MAPPO
paper code's instead: its knowledge section
(:meth:`~mappo.envs.hanabi.game.HanabiGames.paper_belief`) and a one-hot of the player to act
appended (to the global state too, which then starts with the own hand), as its env does.

The global state (the centralized critic's input) is the observation of the player to act with
that player's own hand added (one-hot per slot): the only information the players do not share
is their own cards, so this is the whole game seen from the acting seat. It is the paper code's
critic input (its Hanabi env's ``share_obs``: the acting player's own hand and observation);
the one-hot of the player to act that the paper code appends to both inputs is there with
``observation="paper"`` only.

Games end by themselves (lives, complete fireworks, the last round after the deck); no time
limit cuts them, so every end is a termination. Episode statistics: ``score``, ``perfect`` (1
for 25 in the full game), ``lives_lost``, ``length`` (moves), and the moves of each kind made in
the game: ``discards``, ``plays`` and ``hints`` (what a policy does: one that hints much and
plays little runs out of cards with a low score).

A game is replayed exactly by dealing a given deck order (:meth:`HanabiEnv.deal`).

Observations and the global state are 0/1 and come as bytes (``dtype="uint8"``, the default:
the env declares :attr:`~mappo.envs.base.BatchedEnv.byte_observations`, the library's networks
convert their inputs, and a step at 4,096 games writes a quarter of the memory) or as float32
(``dtype="float32"``); the values are the same.

``backend`` picks how the games step (:class:`~mappo.envs.hanabi.game.HanabiGames`): ``"auto"``
(the C code of :mod:`mappo.envs.hanabi.native` on a CPU where it builds, else torch),
``"native"`` or ``"torch"``; the same steps either way.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from functools import partial

import numpy as np
import torch
from torch import Tensor

from mappo.data import LazyGroups
from mappo.envs.base import ActionSpec, BatchedEnv, EnvError, EnvSpec, EnvStep, GroupSpec
from mappo.envs.hanabi.game import (
    DISCARD,
    PLAY,
    REVEAL_COLOR,
    HanabiGames,
    HanabiRules,
    as_float,
)

COLOR_LETTERS = "RYGWB"
VIEW_DTYPES = {"float32": torch.float32, "uint8": torch.uint8}
"""The dtypes the observations and the global state may come in (``dtype``; 0/1 either way)."""
MOVE_KINDS = ("discards", "plays", "hints")
"""The episode statistics counting a game's moves by kind, in the order of the move uids."""


def _whole_numbers(x: Tensor) -> bool:
    """Whether ``x`` holds integers: an integer dtype, or finite floats without a fraction (not
    flags, not complex numbers)."""
    if x.dtype == torch.bool or x.is_complex():
        return False
    return not x.is_floating_point() or bool((x.isfinite() & (x == x.round())).all())


class HanabiEnv(BatchedEnv):
    """``num_envs`` Hanabi games of ``rules``; one group ``players`` of ``P`` agents."""

    byte_observations = True  # the canonical encodings and the global state are all 0/1

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        players: int = 2,
        colors: int = 5,
        ranks: int = 5,
        hand_size: int | None = None,
        max_information_tokens: int = 8,
        max_life_tokens: int = 3,
        observation: str = "canonical",
        backend: str = "auto",
        dtype: str = "uint8",
    ) -> None:
        super().__init__(num_envs, device, seed)
        if dtype not in VIEW_DTYPES:
            raise EnvError(
                f"hanabi: dtype must be one of {', '.join(VIEW_DTYPES)} (the observations' and "
                f"global state's), got {dtype!r}"
            )
        self.dtype = VIEW_DTYPES[dtype]
        if observation not in ("canonical", "paper"):
            raise EnvError(
                f"hanabi: observation must be 'canonical' (the HLE's, as OpenSpiel returns it) "
                f"or 'paper' (the MAPPO paper code's), got {observation!r}"
            )
        self.observation = observation
        try:
            self.rules = HanabiRules(
                players, colors, ranks, hand_size, max_information_tokens, max_life_tokens
            )
        except ValueError as err:
            raise EnvError(f"hanabi: {err}") from err
        r = self.rules
        self.name = f"hanabi ({r.players} players, {r.colors} colors x {r.ranks} ranks)"
        try:
            self.games = HanabiGames(r, num_envs, self.device, backend)
        except ValueError as err:
            raise EnvError(f"{self.name}: {err}") from err
        self._cards = r.colors * r.ranks
        obs_size = r.observation_size + (r.players if observation == "paper" else 0)
        # Moves run out long before this: each discard or play returns at most one token, so a
        # game has at most D draws + P final moves and as many hints as tokens it ever holds.
        limit = 2 * r.deck_size + r.max_information_tokens + r.players
        self.spec = EnvSpec(
            groups={
                "players": GroupSpec(
                    agents=tuple(f"player_{i}" for i in range(r.players)),
                    obs_shape=(obs_size,),
                    action=ActionSpec((r.num_moves,)),
                    has_action_mask=True,
                )
            },
            state_shape=(obs_size + r.hand * self._cards,),
            episode_limit=limit,
            stat_names=("score", "perfect", "lives_lost", "length", *MOVE_KINDS),
        )
        self._length = torch.zeros(num_envs, dtype=torch.int64, device=self.device)
        self.keep_ended = False
        """While True, each step keeps the games' state before their auto-reset, which
        :meth:`render_ended` draws (recordings set it; training leaves it off: a copy a step)."""
        self._ended: dict[str, Tensor] | None = None
        self._moves = torch.zeros(num_envs, len(MOVE_KINDS), dtype=torch.int64, device=self.device)
        """Moves of each kind of :data:`MOVE_KINDS` made in each running game ``[E, 3]``."""
        self._seats = torch.arange(r.players, device=self.device)
        self._view_buffer: Tensor | None = None
        """Every player's observation ``[E, P, obs]`` bool, rewritten by each step's views."""
        self._sync_free = self.device.type == "cuda"
        """Step without reading anything back to the host (the GPU path)."""

    # -- the contract ----------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> EnvStep:
        if seed is not None:
            self.generator.manual_seed(seed)
        self.games.reset(self.games.shuffled_decks(self.generator))
        self._length.zero_()
        self._moves.zero_()
        return self._first_step()

    def deal(self, decks: Tensor) -> EnvStep:
        """Start every game from a given deck order ``decks [E, D]`` (card ids ``color * R +
        rank``, dealt from index 0, player 0's hand first): deck injection, for replaying a game
        exactly (e.g. one recorded in OpenSpiel)."""
        try:
            decks = torch.as_tensor(decks, device=self.device)
        except (TypeError, ValueError, RuntimeError) as err:
            raise EnvError(f"{self.name}: decks must be an integer tensor or array: {err}") from err
        if not _whole_numbers(decks):
            raise EnvError(f"{self.name}: decks must hold whole card ids, got {decks.dtype}")
        # a copy: the games must not share memory with the caller's tensor
        decks = decks.long().clone()
        d = self.rules.deck_size
        if decks.shape != (self.num_envs, d):
            raise EnvError(f"{self.name}: decks must be [{self.num_envs}, {d}], got {decks.shape}")
        counts = torch.zeros(self.num_envs, self._cards, dtype=torch.int64, device=self.device)
        counts.scatter_add_(1, decks.long().clamp(0, self._cards - 1), torch.ones_like(decks))
        if (
            (decks < 0).any()
            or (decks >= self._cards).any()
            or (counts != self.games.card_counts).any()
        ):
            raise EnvError(
                f"{self.name}: every deck must hold each card as often as the rules say "
                f"({self.games.card_counts.tolist()} copies of cards 0..{self._cards - 1})"
            )
        self.games.reset(decks)
        self._length.zero_()
        self._moves.zero_()
        return self._first_step()

    def _require_games(self, what: str) -> None:
        """Refuse ``what`` on an env whose games were never started (no state to act on)."""
        if not self.games.state:
            raise EnvError(f"{self.name}: {what} before any game; call reset() or deal() first")

    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        self._require_games("step()")
        g = self.games
        if g.native is not None:  # the move, its reward and the statistics in one pass in C
            shared, stat_rows = g.env_step(actions["players"], self._length, self._moves)
            stats = dict(zip(self.spec.stat_names, stat_rows, strict=True))
        else:
            shared, stats = self._move(actions["players"])
        done = g.state["over"].clone()
        if self.keep_ended:  # (a recording: the ended game's last state, for its last frame)
            self._ended = {k: v.clone() for k, v in g.state.items()}
        # Finished games start again at once (auto-reset); their final views go to final_*.
        final_obs: Mapping[str, Tensor]
        final_mask: Mapping[str, Tensor]
        if self._sync_free:
            # On a GPU: no host sync (no test of done, no index list); every game draws a deck
            # and the unfinished ones keep theirs.
            final_views, final_state, final_masks, _ = self._views()
            final_obs, final_mask = {"players": final_views}, {"players": final_masks}
            fresh = g.shuffled_decks(self.generator)
            g.reset(torch.where(done[:, None], fresh, g.state["deck"]), done)
            self._length = torch.where(done, 0, self._length)
            self._moves = torch.where(done[:, None], 0, self._moves)
            obs, state, mask, alive = self._views()
        elif bool(done.any()):
            # On the CPU only the finished games are observed before their reset, draw a deck
            # (shuffling all of them is the costliest part of a step at thousands of games) and
            # are dealt again, and every game is observed once after it. The final observations
            # are put together when read (a trainer that bootstraps only truncated episodes,
            # which Hanabi does not have, never does).
            ids = done.nonzero().squeeze(1)
            ended_obs, ended_state, ended_mask, _ = self._views(ids)
            g.deal_shuffled(ids, self.generator)
            self._length[ids] = 0
            self._moves[ids] = 0
            obs, state, mask, alive = self._views()
            final_obs = LazyGroups({"players": lambda: _with_rows(obs, ids, ended_obs)})
            final_state = partial(_with_rows, state, ids, ended_state)
            final_mask = LazyGroups({"players": lambda: _with_rows(mask, ids, ended_mask)})
        else:
            obs, state, mask, alive = self._views()
            final_obs, final_state, final_mask = {"players": obs}, state, {"players": mask}
        return EnvStep(
            obs={"players": obs},
            state=state,
            reward={"players": shared},
            terminated=done,
            truncated=torch.zeros_like(done),
            alive={"players": alive},
            action_mask={"players": mask},
            final_obs=final_obs,
            final_state=final_state,
            final_action_mask=final_mask,
            stats=stats,
        )

    def _move(self, actions: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The player to act's move of ``actions [E, P]`` in every game, counted in the
        statistics; returns every player's reward ``[E, P]`` and the statistics after it."""
        g = self.games
        acts = actions.reshape(self.num_envs, self.rules.players)
        moves = acts.gather(1, g.state["player"][:, None]).squeeze(1)
        h = self.rules.hand
        # discard slot i is move i, play slot i is H + i, every later move a hint
        kind = (moves >= h).long() + (moves >= 2 * h).long()  # [E] index into MOVE_KINDS
        self._moves += (
            torch.nn.functional.one_hot(kind, len(MOVE_KINDS)) * (~g.state["over"])[:, None]
        )
        reward = g.step(moves)
        self._length += 1
        lost = (self.rules.max_life_tokens - g.state["life"]).float()
        score = g.score().float()
        stats = {
            "score": score,
            "perfect": (score == self._cards).float(),
            "lives_lost": lost,
            "length": self._length.float(),
            **{k: self._moves[:, i].float() for i, k in enumerate(MOVE_KINDS)},
        }
        shared = reward[:, None].expand(self.num_envs, self.rules.players).contiguous()
        return shared, stats

    def get_state(self) -> dict[str, Tensor]:
        self._require_games("get_state()")
        out = {k: v.clone() for k, v in self.games.state.items()}
        out["length"] = self._length.clone()
        out["move_counts"] = self._moves.clone()
        return out

    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        if env_ids is None:
            ids = torch.arange(self.num_envs, device=self.device)
        else:
            ids = torch.as_tensor(env_ids, device=self.device)
            if ids.dtype in (torch.bool, torch.float16, torch.float32, torch.float64):
                raise EnvError(f"{self.name}: env_ids must be integer indices, got {ids.dtype}")
            ids = ids.long().reshape(-1)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_envs):
                raise EnvError(f"{self.name}: env_ids must lie in [0, {self.num_envs})")
            if ids.unique().numel() != ids.numel():
                raise EnvError(f"{self.name}: env_ids must not repeat an env")
        if not self.games.state:  # a new env: games of a sorted deck, whose fields the
            # given state then overwrites (in every env, or in env_ids; the others keep them)
            counts = self.games.card_counts.to(self.device)
            deck = torch.repeat_interleave(torch.arange(counts.numel(), device=self.device), counts)
            self.games.reset(deck.expand(self.num_envs, -1).clone())
        # the statistics' move counts may be left out (states saved before they existed):
        # those games count their moves from zero
        keys = set(self.games.state) | {"length"}
        given = set(state) - {"move_counts"}
        if given != keys:
            raise EnvError(
                f"{self.name}: set_state needs every key of get_state() (a game's fields "
                f"depend on each other: change what get_state() returns and pass all of it "
                f"back); missing {sorted(keys - given)}, unknown {sorted(given - keys)}"
            )
        if "move_counts" not in state:
            state = {**state, "move_counts": torch.zeros_like(self._moves[: ids.numel()])}
        r = self.rules
        top = max(r.colors, r.ranks) - 1
        limits = {  # what a game can hold (a state out of these would index past its tables)
            "player": (0, r.players - 1),
            "hands": (-1, self._cards - 1),
            "deck": (0, self._cards - 1),
            "hand_count": (0, r.hand),
            "dealt": (0, r.deck_size),
            "fireworks": (0, r.ranks),
            "color_hint": (-1, r.colors - 1),
            "rank_hint": (-1, r.ranks - 1),
            "info": (0, r.max_information_tokens),
            "life": (0, r.max_life_tokens),
            "discards": (0, r.instances(0)),
            "turns_left": (0, r.players),
            "last_kind": (-1, 3),
            "last_player": (0, r.players - 1),
            "last_target": (0, r.players - 1),
            "last_color": (0, top),
            "last_rank": (0, top),
            "last_slot": (0, r.hand - 1),
            "last_card": (0, self._cards - 1),
            "length": (0, None),
            "move_counts": (0, None),
        }
        own = {"length": self._length, "move_counts": self._moves}
        # Every field is checked before any is written: a refused state leaves the games as
        # they were.
        values = {}
        for k, v in state.items():
            target = own[k] if k in own else self.games.state[k]
            v = torch.as_tensor(v)
            if tuple(v.shape[1:]) != tuple(target.shape[1:]) or v.shape[0] != ids.numel():
                raise EnvError(
                    f"{self.name}: state['{k}'] must be [{ids.numel()}, "
                    f"{', '.join(map(str, target.shape[1:]))}], got {list(v.shape)}"
                )
            if target.dtype == torch.bool:
                if v.dtype != torch.bool and v.numel() and not bool(((v == 0) | (v == 1)).all()):
                    raise EnvError(f"{self.name}: state['{k}'] must hold flags (0/1 or bool)")
            elif not _whole_numbers(v):
                raise EnvError(f"{self.name}: state['{k}'] must hold whole numbers ({v.dtype})")
            lo, hi = limits.get(k, (None, None))
            if lo is not None and v.numel():
                low, high = int(v.min()), int(v.max())
                if low < lo or (hi is not None and high > hi):
                    span = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
                    raise EnvError(f"{self.name}: state['{k}'] must hold values {span}")
            values[k] = (target, v)
        for target, v in values.values():
            target[ids] = v.to(self.device, target.dtype)
        return self._first_step()

    # -- views -----------------------------------------------------------------------------------
    def _views(self, ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every player's observation ``[E, P, obs]``, the state ``[E, state]``, the action masks
        ``[E, P, M]`` and who acts ``[E, P]``, of every game (or of games ``ids [K]``)."""
        paper = self.observation == "paper"
        if self.games.native is not None:  # the C code writes all four in one pass
            return self.games.views(paper, ids, self.dtype)
        g = self.games if ids is None else self.games.select(ids)
        games = None if ids is None else g
        e, p = g.batch, self.rules.players
        me = g.state["player"]
        n_obs = self.spec.groups["players"].obs_shape[0]
        # The bool views are written into a buffer kept from step to step; what is returned
        # are fresh tensors (bytes or float32) copied or converted from it.
        if games is not None:  # a selection of games: a buffer of its own
            buffer = torch.empty(e, p, n_obs, dtype=torch.bool, device=self.device)
        else:
            if self._view_buffer is None:
                self._view_buffer = torch.empty(e, p, n_obs, dtype=torch.bool, device=self.device)
            buffer = self._view_buffer
        g.observe_all(paper_belief=paper, out=buffer)
        if paper:  # the paper code appends who acts (a one-hot by absolute seat) to every input
            torch.eq(me[:, None, None].expand(e, p, 1), self._seats, out=buffer[:, :, -p:])
        rows = torch.arange(e, device=self.device)
        hand = g.state["hands"][rows, me]  # [E, H]; empty slots (-1) one-hot to nothing
        hand_bits = g.hand_bits(hand).view(e, -1)
        # the paper code's order: the own hand first
        cols = (hand_bits.shape[1], n_obs) if paper else (n_obs, hand_bits.shape[1])
        state = torch.empty(e, sum(cols), dtype=self.dtype, device=self.device)
        view_cols, hand_cols = state.split(cols, dim=1)[:: -1 if paper else 1]
        as_bytes = buffer.view(torch.uint8)
        view_cols.copy_(as_bytes[rows, me])
        hand_cols.copy_(hand_bits.view(torch.uint8))
        obs = as_float(buffer) if self.dtype == torch.float32 else as_bytes.clone()
        # Nobody acts in a finished game (its final views): every seat gets the idle mask.
        alive = (self._seats[None, :] == me[:, None]) & ~g.state["over"][:, None]
        legal = g.legal_moves()
        idle = torch.zeros_like(legal)
        idle[:, 0] = True
        mask = torch.where(alive[:, :, None], legal[:, None, :], idle[:, None, :])
        return obs, state, mask, alive

    def _first_step(self) -> EnvStep:
        obs, state, mask, alive = self._views()
        e, p, dev = self.num_envs, self.rules.players, self.device
        return EnvStep(
            obs={"players": obs},
            state=state,
            reward={"players": torch.zeros(e, p, device=dev)},
            terminated=torch.zeros(e, dtype=torch.bool, device=dev),
            truncated=torch.zeros(e, dtype=torch.bool, device=dev),
            alive={"players": alive},
            action_mask={"players": mask},
            stats={k: torch.zeros(e, device=dev) for k in self.spec.stat_names},
        )

    # -- reading a game --------------------------------------------------------------------------
    def render_text(self, env_index: int = 0, ended: bool = False) -> str:
        """Game ``env_index`` as text: tokens, fireworks, every hand with what its holder knows
        (``R3||R?`` = a red 3 whose holder knows it is red), discards and the deck.
        ``ended``: the game as the step that ended it left it, before its auto-reset (kept
        while :attr:`keep_ended` is set; a recorded episode's last frame), which says how it
        ended where the others say who acts next."""
        r, i = self.rules, env_index
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_envs:
            raise EnvError(f"{self.name}: env_index must be 0 to {self.num_envs - 1}, got {i!r}")
        if not ended:
            self._require_games("render")
        s = self._ended_state() if ended else self.games.state

        def card(c: int) -> str:
            return f"{COLOR_LETTERS[c // r.ranks]}{c % r.ranks + 1}"

        fw = " ".join(f"{COLOR_LETTERS[c]}{int(s['fireworks'][i, c])}" for c in range(r.colors))
        lines = [
            f"score {int(s['fireworks'][i].sum()) if int(s['life'][i]) > 0 else 0}  "
            f"info {int(s['info'][i])}  "
            f"lives {int(s['life'][i])}  deck {r.deck_size - int(s['dealt'][i])}  "
            + (self._how_it_ended(i, s) if ended else f"to act: player {int(s['player'][i])}"),
            f"fireworks: {fw}",
        ]
        for p in range(r.players):
            cards = []
            for k in range(int(s["hand_count"][i, p])):
                ch, rh = int(s["color_hint"][i, p, k]), int(s["rank_hint"][i, p, k])
                known = (COLOR_LETTERS[ch] if ch >= 0 else "?") + (str(rh + 1) if rh >= 0 else "?")
                cards.append(f"{card(int(s['hands'][i, p, k]))}||{known}")
            lines.append(f"player {p}: " + "  ".join(cards))
        disc = [f"{card(c)}x{int(n)}" for c, n in enumerate(s["discards"][i].tolist()) if n > 0]
        lines.append("discards: " + (" ".join(disc) if disc else "-"))
        lines.append("last move: " + self._last_move_text(i, s))
        return "\n".join(lines)

    def _how_it_ended(self, i: int, s: dict[str, Tensor]) -> str:
        r = self.rules
        if int(s["life"][i]) == 0:
            return "game over: no lives left"
        if int(s["fireworks"][i].sum()) == r.colors * r.ranks:
            return "game over: every firework complete"
        return "game over: the deck ran out"

    def _ended_state(self) -> dict[str, Tensor]:
        if self._ended is None:
            raise EnvError(
                f"{self.name}: no ended game kept; set keep_ended = True before the steps"
            )
        return self._ended

    def _last_move_text(self, i: int, s: dict[str, Tensor]) -> str:
        r = self.rules
        kind = int(s["last_kind"][i])
        if kind < 0:
            return "-"
        who = f"player {int(s['last_player'][i])}"
        if kind in (PLAY, DISCARD):
            c = int(s["last_card"][i])
            what = f"{COLOR_LETTERS[c // r.ranks]}{c % r.ranks + 1}"
            slot = int(s["last_slot"][i])
            if kind == DISCARD:
                return f"{who} discarded {what} (slot {slot})"
            ok = "scored" if bool(s["last_scored"][i]) else "misplayed, a life lost"
            return f"{who} played {what} (slot {slot}): {ok}"
        value = int(s["last_color"][i])
        told = COLOR_LETTERS[value] if kind == REVEAL_COLOR else str(value + 1)
        slots = [k for k in range(r.hand) if bool(s["last_revealed"][i, k])]
        return f"{who} told player {int(s['last_target'][i])}: {told} at slots {slots}"

    def render_ended(self, env_index: int = 0) -> np.ndarray:
        """The frame of game ``env_index`` as its last step left it (see :attr:`keep_ended`)."""
        return self.render(env_index, ended=True)

    def render(self, env_index: int = 0, size: int = 400, ended: bool = False) -> np.ndarray:
        """Game ``env_index`` drawn as its text (:meth:`render_text`), each card in its color:
        an RGB frame ``[H, W, 3]`` uint8 (``size`` is the least width in pixels)."""
        from PIL import Image, ImageDraw, ImageFont

        # Every frame has the same size (a GIF needs it): 88 characters a line, long lines
        # (the discards) wrapped, room for the most lines a game of these rules can have.
        chars = 88
        lines = []
        for line in self.render_text(env_index, ended).splitlines():
            lines.extend(textwrap.wrap(line, chars, subsequent_indent="  ") or [""])
        font = ImageFont.load_default()
        step = 14
        rows = self.rules.players + 3 + math.ceil(30 * self._cards / (chars - 2)) + 2
        image = Image.new("RGB", (max(size, 8 + 7 * chars), 10 + step * rows), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for row, line in enumerate(lines):
            x, y = 6, 5 + row * step
            for word in line.split(" "):
                ink = _INK.get(word[:1], (0, 0, 0)) if "||" in word else (0, 0, 0)
                draw.text((x, y), word, fill=ink, font=font)
                x += int(draw.textlength(word + " ", font=font))
        return np.asarray(image, dtype=np.uint8)


# The card colors' ink in a rendered frame (white cards in grey, to show on white).
_INK = {
    "R": (200, 30, 30),
    "Y": (190, 150, 0),
    "G": (20, 140, 40),
    "W": (120, 120, 120),
    "B": (30, 70, 200),
}


def _with_rows(whole: Tensor, ids: Tensor, rows: Tensor) -> Tensor:
    """A copy of ``whole [E, ...]`` with rows ``ids [K]`` replaced by ``rows [K, ...]``."""
    out = whole.clone()
    out[ids] = rows
    return out
