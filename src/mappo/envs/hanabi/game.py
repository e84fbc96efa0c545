"""Hanabi, batched on a torch device: the rules and the canonical observation of the Hanabi
Learning Environment (Bard et al. 2020, "The Hanabi Challenge"; the HLE is what OpenSpiel's
``hanabi`` game wraps), for ``B`` games at once.

Conventions, all the HLE's (so that a game replayed here and in OpenSpiel agrees bit for bit):

- A card is ``color * R + rank`` (``C`` colors, ``R`` ranks, both 0-based). Each color has three
  cards of rank 0, one of the top rank and two of every other rank.
- Moves of the player to act, numbered as the HLE's move uids (OpenSpiel's actions): discard
  slot ``i`` (``0 .. H-1``), play slot ``i`` (``H .. 2H-1``), reveal color ``c`` to the player
  ``o`` seats on (``2H + (o - 1) * C + c``), reveal rank ``r`` to that player
  (``2H + (P - 1) * C + (o - 1) * R + r``).
- Playing or discarding removes the card from its slot, the cards to its right move one slot
  left, and the replacement (if the deck has cards) is dealt into the last slot. Discarding is
  illegal at full information tokens; a reveal costs a token and must touch at least one card.
- A played card that is the next of its color scores; a top-rank card also returns a token (if
  not full). A misplay costs a life and goes to the discards.
- The game ends when the last life is lost (the score then counts as 0), when every firework is
  complete, or once the deck is empty and every player has made one more move.
- The score is the sum of the fireworks; the reward of a move is the change of the score (so
  losing the last life gives minus the score reached).

The deck is drawn up front as an order of the ``D`` cards (``decks [B, D]``); dealing takes the
next card of it, which is how a game is replayed exactly (deck injection).

Shapes: ``B`` games, ``P`` players, ``H`` hand size, ``C`` colors, ``R`` ranks, ``D`` cards.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, fields

import torch
from torch import Tensor


def _whole(value: object) -> bool:
    """Whether ``value`` is an integer (a Python int or a type that converts like one, such as
    NumPy's)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


@dataclass(frozen=True)
class HanabiRules:
    """The parameters of a Hanabi variant (the HLE's defaults: the full game)."""

    players: int = 2
    colors: int = 5
    ranks: int = 5
    hand_size: int | None = None  # None: 5 cards for 2-3 players, 4 for 4-5 (the HLE's rule)
    max_information_tokens: int = 8
    max_life_tokens: int = 3

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "hand_size":
                continue  # the HLE's rule picks the hand size
            # bool passes as an int in Python; a flag where a count belongs is a mistake
            if isinstance(value, bool) or not _whole(value):
                raise ValueError(f"Hanabi's {field.name} must be a whole number, got {value!r}")
        if not 2 <= self.players <= 5:
            raise ValueError(f"Hanabi needs 2-5 players, got players={self.players}")
        if not 1 <= self.colors <= 5 or not 1 <= self.ranks <= 5:
            raise ValueError(
                f"Hanabi has 1-5 colors and 1-5 ranks, got colors={self.colors}, ranks={self.ranks}"
            )
        if self.hand < 1 or self.players * self.hand > self.deck_size:
            raise ValueError(
                f"hand_size={self.hand} for {self.players} players needs 1 to "
                f"{self.deck_size // self.players} cards per hand (the deck holds "
                f"{self.deck_size})"
            )
        if self.max_life_tokens < 1 or self.max_information_tokens < 0:
            raise ValueError(
                f"Hanabi needs at least one life token and no negative information tokens, got "
                f"max_life_tokens={self.max_life_tokens}, "
                f"max_information_tokens={self.max_information_tokens}"
            )

    @property
    def hand(self) -> int:
        """Cards per hand ``H``."""
        if self.hand_size is not None:
            return self.hand_size
        return 5 if self.players < 4 else 4

    def instances(self, rank: int) -> int:
        """Copies of each card of ``rank`` (the HLE's NumberCardInstances)."""
        if rank == 0:
            return 3
        if rank == self.ranks - 1:
            return 1
        return 2

    @property
    def deck_size(self) -> int:
        """Cards in the deck ``D``."""
        return self.colors * sum(self.instances(r) for r in range(self.ranks))

    @property
    def num_moves(self) -> int:
        """Moves ``2H + (P - 1)(C + R)``."""
        return 2 * self.hand + (self.players - 1) * (self.colors + self.ranks)

    @property
    def observation_size(self) -> int:
        """Length of the canonical observation (658 for the 2-player full game)."""
        p, h, c, r = self.players, self.hand, self.colors, self.ranks
        cards = c * r
        hands = (p - 1) * h * cards + p
        board = (self.deck_size - p * h) + cards + self.max_information_tokens
        board += self.max_life_tokens
        discards = self.deck_size
        last = p + 4 + p + c + r + h + h + cards + 2
        knowledge = p * h * (cards + c + r)
        return hands + board + discards + last + knowledge


# Move kinds (the order of the HLE's move types in the last-action section).
PLAY, DISCARD, REVEAL_COLOR, REVEAL_RANK = 0, 1, 2, 3


class HanabiGames:
    """``B`` Hanabi games stepped together. Every state tensor has a leading ``[B]`` axis.

    ``reset(decks)`` deals from the given deck orders; :meth:`step` applies one move of the
    player to act in every game that is not over (finished games ignore their move).

    ``backend``: ``"torch"`` (tensor operations over the batch, on any device), ``"native"``
    (the step, the legal moves, the views and the deals of :mod:`mappo.envs.hanabi.native`'s C
    code, on the same state tensors: CPU only; ``ValueError`` where it cannot be built) or
    ``"auto"`` (native on a CPU where it builds, else torch). Both give the same states,
    rewards and views.
    """

    def __init__(
        self,
        rules: HanabiRules,
        batch: int,
        device: str | torch.device = "cpu",
        backend: str = "auto",
    ):
        self.rules = rules
        self.batch = batch
        self.device = torch.device(device)
        self.native = _native_backend(rules, self.device, backend)
        r = rules
        dev = self.device
        counts = torch.tensor([r.instances(k) for k in range(r.ranks)], device=dev)
        # the unshuffled deck: every card id repeated by its number of copies
        self.card_counts = counts.repeat(r.colors)  # [C*R]
        self.sorted_deck = torch.repeat_interleave(
            torch.arange(r.colors * r.ranks, device=dev), self.card_counts
        )
        self._rows = torch.arange(batch, device=dev)
        self._slots = torch.arange(r.hand, device=dev)
        # index tables of the observation encoding
        p = r.players
        self._seat_ids = torch.arange(p, device=dev)
        # the seat ``k`` places after observer ``o`` (a host table: reading a device tensor's
        # values would stall a GPU step)
        self._seat_of = [[(o + k) % p for k in range(p)] for o in range(p)]
        self._seat_table = torch.tensor(self._seat_of, device=dev)  # the same on the device
        self._card_ids = torch.arange(r.colors * r.ranks, device=dev)
        self._color_ids = torch.arange(r.colors, device=dev)
        self._rank_ids = torch.arange(r.ranks, device=dev)
        self._kind_ids = torch.arange(4, device=dev)
        self._deck_bits = torch.arange(r.deck_size - p * r.hand, device=dev)
        self._info_bits = torch.arange(r.max_information_tokens, device=dev)
        self._life_bits = torch.arange(r.max_life_tokens, device=dev)
        # the discard section: for each bit, its card and which copy of that card it counts
        self._discard_card = torch.repeat_interleave(self._card_ids, self.card_counts)
        self._discard_copy = torch.cat(
            [torch.arange(int(n), device=dev) for n in counts.repeat(r.colors)]
        )
        # Lookup tables of the observation's one-hot blocks (a table row per value is several
        # times faster than comparing against every value on a CPU). A card's one-hot, the last
        # row (index -1, an empty slot) all zero:
        self._card_table = torch.cat(
            [torch.eye(r.colors * r.ranks, dtype=torch.bool, device=dev)]
            + [torch.zeros(1, r.colors * r.ranks, dtype=torch.bool, device=dev)]
        )
        # A slot's knowledge block (plausible cards, revealed color, revealed rank) by its code:
        # the plausible colors and ranks as bit masks, then the revealed color and rank (+1, 0 for
        # none); row ``((color_mask * 2^R + rank_mask) * (C + 1) + color + 1) * (R + 1) + rank + 1``
        cm = torch.arange(2**r.colors, device=dev)[:, None] >> self._color_ids & 1  # [2^C, C]
        rm = torch.arange(2**r.ranks, device=dev)[:, None] >> self._rank_ids & 1  # [2^R, R]
        plausible = (cm[:, None, :, None] & rm[None, :, None, :]).flatten(2)  # [2^C, 2^R, C*R]
        hinted_color = torch.eye(r.colors + 1, dtype=torch.long, device=dev)[:, 1:]  # [C+1, C]
        hinted_rank = torch.eye(r.ranks + 1, dtype=torch.long, device=dev)[:, 1:]  # [R+1, R]
        n_c, n_r = r.colors + 1, r.ranks + 1
        self._knowledge_table = (
            torch.cat(
                [
                    plausible[:, :, None, None, :].expand(-1, -1, n_c, n_r, -1),
                    hinted_color[None, None, :, None, :].expand(
                        2**r.colors, 2**r.ranks, -1, n_r, -1
                    ),
                    hinted_rank[None, None, None, :, :].expand(
                        2**r.colors, 2**r.ranks, n_c, -1, -1
                    ),
                ],
                dim=-1,
            )
            .reshape(-1, r.colors * r.ranks + r.colors + r.ranks)
            .bool()
        )
        self._color_weights = (2**self._color_ids).float() * (2**r.ranks * n_c * n_r)
        self._rank_weights = (2**self._rank_ids).float() * (n_c * n_r)
        self.state: dict[str, Tensor] = {}

    def select(self, ids: Tensor) -> HanabiGames:
        """The games ``ids [K]`` as a batch of their own (copies of their state; the rules'
        tables shared), e.g. to observe only the games that were just reset."""
        sub = copy.copy(self)
        sub.batch = int(ids.numel())
        sub._rows = torch.arange(sub.batch, device=self.device)
        sub.state = {k: v[ids] for k, v in self.state.items()}
        if self.native is not None:
            sub.native = self.native.fresh()
        return sub

    # -- dealing -------------------------------------------------------------------------------
    def shuffled_decks(
        self, generator: torch.Generator | None = None, count: int | None = None
    ) -> Tensor:
        """``[count, D]`` (default ``[B, D]``) independent uniformly shuffled deck orders."""
        n = self.batch if count is None else count
        keys = torch.rand(
            n, self.rules.deck_size, dtype=torch.float32, device=self.device, generator=generator
        )
        if self.native is not None:  # the same sort in C (a torch sort of 50 keys is slow)
            decks = torch.empty(n, self.rules.deck_size, dtype=torch.int64)
            self.native.run("hanabi_shuffle", None, n, None, 0, keys.data_ptr(), decks.data_ptr())
            return decks
        # stable: equal keys (about one deck in 13,000) keep their order, as the C sort does
        return self.sorted_deck[keys.argsort(dim=1, stable=True)]

    def deal_shuffled(self, ids: Tensor, generator: torch.Generator | None = None) -> None:
        """Start new games in rows ``ids [K]`` (distinct, in ``[-B, B)``, negative ids counted
        from the end as torch indexes) from freshly shuffled decks: the same games as
        ``reset_games(ids, shuffled_decks(generator, K))`` (the same draws from ``generator``),
        shuffled and dealt in one pass with the native backend."""
        if self.native is None or not self.state:
            self.reset_games(ids, self.shuffled_decks(generator, int(ids.numel())))
            return
        ids = ids.to(torch.int64).reshape(-1)
        ids = torch.where(ids < 0, ids + self.batch, ids).contiguous()  # as reset_games takes
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.batch:
            # the C code writes at these rows
            raise IndexError(f"game ids must lie in [-{self.batch}, {self.batch})")
        keys = torch.rand(
            ids.numel(), self.rules.deck_size, dtype=torch.float32, generator=generator
        )
        self.native.run("hanabi_shuffle", self.state, ids.numel(), ids, 1, keys.data_ptr(), None)

    def reset(self, decks: Tensor, mask: Tensor | None = None) -> None:
        """Start new games dealt from ``decks [B, D]`` (card ids, dealt from index 0: player 0's
        hand first) where ``mask [B]`` is True (every game when ``None``)."""
        r, b, dev = self.rules, self.batch, self.device
        p, h = r.players, r.hand
        decks = decks.to(dev, torch.int64)
        if self.native is not None:  # the C code indexes tables with the cards
            self._check_cards(decks)
        fresh = {
            "deck": decks.clone(),
            "dealt": torch.full((b,), p * h, dtype=torch.int64, device=dev),
            "hands": decks[:, : p * h].reshape(b, p, h).clone(),
            "hand_count": torch.full((b, p), h, dtype=torch.int64, device=dev),
            "color_ok": torch.ones(b, p, h, r.colors, dtype=torch.bool, device=dev),
            "rank_ok": torch.ones(b, p, h, r.ranks, dtype=torch.bool, device=dev),
            "color_hint": torch.full((b, p, h), -1, dtype=torch.int64, device=dev),
            "rank_hint": torch.full((b, p, h), -1, dtype=torch.int64, device=dev),
            "fireworks": torch.zeros(b, r.colors, dtype=torch.int64, device=dev),
            "info": torch.full((b,), r.max_information_tokens, dtype=torch.int64, device=dev),
            "life": torch.full((b,), r.max_life_tokens, dtype=torch.int64, device=dev),
            "discards": torch.zeros(b, r.colors * r.ranks, dtype=torch.int64, device=dev),
            "player": torch.zeros(b, dtype=torch.int64, device=dev),
            "turns_left": torch.full((b,), p, dtype=torch.int64, device=dev),
            "over": torch.zeros(b, dtype=torch.bool, device=dev),
            # the last move: kind (-1 none), player, target, color, rank, revealed slots
            # [B, H], slot, card, scored, token added
            "last_kind": torch.full((b,), -1, dtype=torch.int64, device=dev),
            "last_player": torch.zeros(b, dtype=torch.int64, device=dev),
            "last_target": torch.zeros(b, dtype=torch.int64, device=dev),
            "last_color": torch.zeros(b, dtype=torch.int64, device=dev),
            "last_rank": torch.zeros(b, dtype=torch.int64, device=dev),
            "last_revealed": torch.zeros(b, h, dtype=torch.bool, device=dev),
            "last_slot": torch.zeros(b, dtype=torch.int64, device=dev),
            "last_card": torch.zeros(b, dtype=torch.int64, device=dev),
            "last_scored": torch.zeros(b, dtype=torch.bool, device=dev),
            "last_token": torch.zeros(b, dtype=torch.bool, device=dev),
        }
        if mask is None or not self.state:
            self.state = fresh
        else:
            self.state = {
                k: torch.where(mask.view(-1, *([1] * (v.dim() - 1))), fresh[k], v)
                for k, v in self.state.items()
            }

    def reset_games(self, ids: Tensor, decks: Tensor) -> None:
        """Start new games in rows ``ids [K]`` (distinct), dealt from ``decks [K, D]``; the
        other games are untouched. Writes only those rows (cheaper than :meth:`reset` with a
        mask when few of many games end)."""
        if self.native is not None and self.state:
            ids = ids.to(torch.int64).reshape(-1)
            ids = torch.where(ids < 0, ids + self.batch, ids).contiguous()  # torch's indexing
            decks = decks.to(torch.int64).contiguous()
            if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.batch:
                raise IndexError(f"game ids must lie in [-{self.batch}, {self.batch})")
            if decks.shape != (ids.numel(), self.rules.deck_size):
                raise ValueError(f"decks must be [{ids.numel()}, {self.rules.deck_size}]")
            self._check_cards(decks)
            self.native.run("hanabi_deal", self.state, ids.numel(), ids, decks.data_ptr())
            return
        fresh = copy.copy(self)
        fresh.batch = int(ids.numel())
        fresh.state = {}
        fresh.reset(decks)
        for k, v in self.state.items():
            v[ids] = fresh.state[k]

    def env_step(self, actions: Tensor, length: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """One step of :class:`~mappo.envs.hanabi.env.HanabiEnv` in one pass (native backend
        only): every player's move ``actions [B, P]`` int64 (the player to act's is made),
        ``length [B]`` int64 counted up and ``counts [B, 3]`` int64 (moves by kind: discards,
        plays, hints) counted for the games that were not over, both in place. Returns every
        player's reward ``[B, P]`` float32 (the change of the score) and the episode statistics
        ``[7, B]`` float32 after the move: score, perfect, lives lost, length, and ``counts``."""
        if self.native is None:
            raise RuntimeError("HanabiGames.env_step needs the native backend")
        b, p = self.batch, self.rules.players
        actions = actions.to(torch.int64).reshape(b, p).contiguous()
        for name, t, shape in (("length", length, (b,)), ("counts", counts, (b, 3))):
            if t.dtype != torch.int64 or t.shape != shape or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int64 tensor of shape {shape}")
        rewards = torch.empty(b, p, dtype=torch.float32)
        stats = torch.empty(7, b, dtype=torch.float32)
        self.native.run(
            "hanabi_env_step",
            self.state,
            b,
            None,
            b,
            actions.data_ptr(),
            length.data_ptr(),
            counts.data_ptr(),
            rewards.data_ptr(),
            stats.data_ptr(),
        )
        return rewards, stats

    def _check_cards(self, decks: Tensor) -> None:
        """Raise ``ValueError`` unless every card id of ``decks`` lies in ``[0, C*R)``."""
        cards = self.rules.colors * self.rules.ranks
        if decks.numel() and not 0 <= int(decks.min()) <= int(decks.max()) < cards:
            raise ValueError(f"card ids must lie in [0, {cards})")

    # -- the score -----------------------------------------------------------------------------
    def score(self) -> Tensor:
        """``[B]`` int64: the fireworks' sum, 0 once the last life is lost."""
        s = self.state
        return torch.where(s["life"] > 0, s["fireworks"].sum(1), 0)

    # -- legal moves ---------------------------------------------------------------------------
    def legal_moves(self) -> Tensor:
        """``[B, M]`` bool: the moves the player to act may make (none in a finished game)."""
        if self.native is not None:
            out = torch.empty(self.batch, self.rules.num_moves, dtype=torch.bool, device="cpu")
            self.native.run("hanabi_legal", self.state, self.batch, None, out.data_ptr())
            return out
        r, s = self.rules, self.state
        p, c = r.players, r.colors
        held = self._slots < s["hand_count"].gather(1, s["player"][:, None])  # [B, H]
        discard = held & (s["info"] < r.max_information_tokens)[:, None]
        play = held
        can_hint = (s["info"] > 0)[:, None]
        colors, ranks = [], []
        for o in range(1, p):
            target = (s["player"] + o) % p
            cards = s["hands"][self._rows, target]  # [B, H]
            there = self._slots < s["hand_count"][self._rows, target][:, None]
            card_color = torch.where(there, cards // r.ranks, -1)
            card_rank = torch.where(there, cards % r.ranks, -1)
            colors.append(
                (card_color[:, :, None] == torch.arange(c, device=self.device)).any(1) & can_hint
            )
            ranks.append(
                (card_rank[:, :, None] == torch.arange(r.ranks, device=self.device)).any(1)
                & can_hint
            )
        legal = torch.cat([discard, play, *colors, *ranks], dim=1)
        return legal & ~s["over"][:, None]

    # -- a move --------------------------------------------------------------------------------
    def step(self, moves: Tensor) -> Tensor:
        """Apply ``moves [B]`` (move uids, legal ones: see :meth:`legal_moves`) for the player to
        act in every unfinished game; returns the rewards ``[B]`` float32 (score changes).

        The torch backend puts new tensors into :attr:`state`; the native one writes into the
        ones there (copy what must stay as it was, as :meth:`select` does)."""
        if self.native is not None:
            moves = moves.to(torch.int64).contiguous()
            if moves.shape != (self.batch,):
                raise ValueError(f"moves must be [{self.batch}], got {list(moves.shape)}")
            rewards = torch.empty(self.batch, dtype=torch.float32, device="cpu")
            self.native.run(
                "hanabi_step", self.state, self.batch, None, moves.data_ptr(), rewards.data_ptr()
            )
            return rewards
        r, s = self.rules, self.state
        p, h, c = r.players, r.hand, r.colors
        rows, dev = self._rows, self.device
        live = ~s["over"]
        before = self.score()
        moves = moves.to(dev, torch.int64)
        me = s["player"]
        # A move made with the deck already empty counts down the last round.
        s["turns_left"] = torch.where(
            live & (s["dealt"] >= r.deck_size), s["turns_left"] - 1, s["turns_left"]
        )
        is_discard = live & (moves < h)
        is_play = live & (moves >= h) & (moves < 2 * h)
        hint = moves - 2 * h
        is_color = live & (hint >= 0) & (hint < (p - 1) * c)
        is_rank = live & (hint >= (p - 1) * c)
        slot = torch.where(moves < h, moves, moves - h).clamp(0, h - 1)

        # -- play and discard ---------------------------------------------------------------
        leaves = is_discard | is_play
        card = s["hands"][rows, me, slot]  # [B]
        color, rank = card // r.ranks, card % r.ranks
        fw = s["fireworks"]
        fits = fw[rows, color] == rank
        scored = is_play & fits
        s["fireworks"] = fw.clone()
        s["fireworks"][rows, color] = torch.where(scored, fw[rows, color] + 1, fw[rows, color])
        token = (is_discard | (scored & (rank == r.ranks - 1))) & (
            s["info"] < r.max_information_tokens
        )
        s["info"] = s["info"] + token.long()
        s["life"] = s["life"] - (is_play & ~fits).long()
        to_discard = is_discard | (is_play & ~fits)
        s["discards"] = s["discards"].clone()
        s["discards"][rows, card] += to_discard.long()
        self._remove_and_draw(leaves, me, slot)

        # -- reveals --------------------------------------------------------------------------
        offset = torch.where(is_color, hint // c, (hint - (p - 1) * c) // r.ranks) + 1
        target = (me + offset) % p
        value = torch.where(is_color, hint % c, (hint - (p - 1) * c) % r.ranks)
        cards = s["hands"][rows, target]  # [B, H]
        there = self._slots < s["hand_count"][rows, target][:, None]
        hit_color = there & (cards // r.ranks == value[:, None]) & is_color[:, None]
        hit_rank = there & (cards % r.ranks == value[:, None]) & is_rank[:, None]
        revealed = hit_color | hit_rank
        hinting = is_color | is_rank
        s["info"] = s["info"] - hinting.long()
        self._apply_hint(is_color, is_rank, target, value, hit_color, hit_rank, there)

        # -- the last move, for the observation -------------------------------------------------
        kind = torch.full_like(moves, -1)
        kind = torch.where(is_play, PLAY, kind)
        kind = torch.where(is_discard, DISCARD, kind)
        kind = torch.where(is_color, REVEAL_COLOR, kind)
        kind = torch.where(is_rank, REVEAL_RANK, kind)

        def keep(name: str, new: Tensor) -> None:
            old = s[name]
            m = live.view(-1, *([1] * (old.dim() - 1)))
            s[name] = torch.where(m, new, old)

        keep("last_kind", kind)
        keep("last_player", me)
        keep("last_target", target)
        keep("last_color", value)
        keep("last_rank", value)
        keep("last_revealed", revealed)
        keep("last_slot", slot)
        keep("last_card", card)
        keep("last_scored", scored)
        keep("last_token", token)

        # -- the next player and the end ----------------------------------------------------------
        s["player"] = torch.where(live, (me + 1) % p, me)
        complete = s["fireworks"].sum(1) >= c * r.ranks
        s["over"] = s["over"] | (live & ((s["life"] <= 0) | complete | (s["turns_left"] <= 0)))
        return (self.score() - before).to(torch.float32)

    def _remove_and_draw(self, leaves: Tensor, me: Tensor, slot: Tensor) -> None:
        """Take the card in ``slot`` out of the acting player's hand where ``leaves``: the cards
        right of it move one slot left and the deck's next card (if any) fills the last slot."""
        r, s, rows = self.rules, self.state, self._rows
        h = r.hand
        count = s["hand_count"][rows, me]
        has_card = s["dealt"] < r.deck_size
        # source slot of each slot after the removal
        src = self._slots[None, :] + (self._slots[None, :] >= slot[:, None]).long()
        src = src.clamp(max=h - 1)
        last = count - 1  # the slot the replacement goes to (the hand was full before)
        new_card = s["deck"][rows, s["dealt"].clamp(max=r.deck_size - 1)]
        fill = (self._slots[None, :] == last[:, None]) & has_card[:, None]
        empty = (self._slots[None, :] >= last[:, None]) & ~has_card[:, None]
        moved = leaves[:, None]

        def shift(name: str, fresh_value: Tensor | float | int, blank: Tensor | float | int):
            full = s[name]
            hand = full[rows, me]  # [B, H, ...]
            idx = src.view(*src.shape, *([1] * (hand.dim() - 2))).expand_as(hand)
            out = hand.gather(1, idx)
            f = fill.view(*fill.shape, *([1] * (hand.dim() - 2)))
            e = empty.view(*empty.shape, *([1] * (hand.dim() - 2)))
            out = torch.where(f, fresh_value, out)
            out = torch.where(e, blank, out)
            m = moved.view(-1, *([1] * (hand.dim() - 1)))
            full = full.clone()
            full[rows, me] = torch.where(m, out, hand)
            s[name] = full

        shift("hands", new_card[:, None], -1)
        # a new card could be anything; an empty slot (the deck ran out) is nothing
        shift("color_ok", True, False)
        shift("rank_ok", True, False)
        shift("color_hint", -1, -1)
        shift("rank_hint", -1, -1)
        drew = leaves & has_card
        s["dealt"] = s["dealt"] + drew.long()
        s["hand_count"] = s["hand_count"].clone()
        s["hand_count"][rows, me] = count - (leaves & ~has_card).long()

    def _apply_hint(
        self,
        is_color: Tensor,
        is_rank: Tensor,
        target: Tensor,
        value: Tensor,
        hit_color: Tensor,
        hit_rank: Tensor,
        there: Tensor,
    ) -> None:
        """Update the target's card knowledge: a revealed card knows its color (rank); every
        other card of the hand learns it is not that color (rank)."""
        r, s, rows = self.rules, self.state, self._rows
        for is_kind, hit, ok_key, hint_key, size in (
            (is_color, hit_color, "color_ok", "color_hint", r.colors),
            (is_rank, hit_rank, "rank_ok", "rank_hint", r.ranks),
        ):
            ok = s[ok_key][rows, target]  # [B, H, C or R]
            is_v = torch.arange(size, device=self.device)[None, None, :] == value[:, None, None]
            new_ok = torch.where(hit[:, :, None], is_v, ok & ~is_v)
            apply = (is_kind[:, None] & there)[:, :, None]
            s[ok_key] = s[ok_key].clone()
            s[ok_key][rows, target] = torch.where(apply, new_ok, ok)
            hint = s[hint_key][rows, target]
            s[hint_key] = s[hint_key].clone()
            s[hint_key][rows, target] = torch.where(hit, value[:, None], hint)

    # -- the canonical observation ---------------------------------------------------------------
    def observe(self, observer: Tensor) -> Tensor:
        """``[B, observation_size]`` float32: the HLE's canonical encoding of what player
        ``observer [B]`` sees (OpenSpiel's ``observation_tensor``); see :meth:`observe_all`."""
        return as_float(self.observe_all()[self._rows, observer])

    def hand_bits(self, cards: Tensor) -> Tensor:
        """``cards [...]`` (card ids, -1 for an empty slot) one-hot: ``[..., C*R]`` bool."""
        table = self._card_table
        return table.index_select(0, cards.flatten() % table.shape[0]).view(*cards.shape, -1)

    def observe_all(self, paper_belief: bool = False, out: Tensor | None = None) -> Tensor:
        """``[B, P, observation_size]`` bool: every player's canonical observation, by seat.

        Sections, each from the observer's seat on (offset ``k`` = the player ``k`` seats
        later): the other players' hands (one-hot cards) and which hands are short of a card;
        the board (deck, fireworks, information and life thermometers); the discards (per card,
        a thermometer over its copies); the last move (player, kind, target, color, rank,
        revealed slots, slot, card, scored, token returned by a play); every player's card
        knowledge (plausible cards, revealed color, revealed rank).

        ``paper_belief``: the knowledge section's plausible cards as the MAPPO paper's code
        encodes them (:meth:`paper_belief`) instead. ``out``: a ``[B, P, n >= observation_size]``
        bool tensor to write into (its first ``observation_size`` columns; the rest untouched),
        e.g. one kept from step to step.

        Every section is written in place into the output (no concatenation), the game-wide
        ones once and copied to the other seats, and the one-hot blocks are rows of lookup
        tables: at 4,096 games on a CPU this takes half the time of comparisons and a
        concatenation (BENCHMARKS.md).
        """
        r, s = self.rules, self.state
        p, h, c, rk = r.players, r.hand, r.colors, r.ranks
        cards = c * rk
        b = self.batch
        if out is None:
            out = torch.empty(b, p, r.observation_size, dtype=torch.bool, device=self.device)
        if (
            self.native is not None
            and out.is_contiguous()
            and out.dtype == torch.bool
            and out.dim() == 3
            and out.shape[:2] == (b, p)
            and out.shape[2] >= r.observation_size
        ):
            self.native.run(
                "hanabi_observe", s, b, None, int(paper_belief), out.data_ptr(), out.shape[2]
            )
            return out
        seat = self._seat_of
        at = 0

        def take(n: int) -> Tensor:  # the next n columns of every observer: [B, P, n]
            nonlocal at
            at += n
            return out[:, :, at - n : at]

        # the other players' hands, one-hot per slot (empty slots, -1, have an all-zero row)
        hand_bits = self.hand_bits(s["hands"]).view(b, p, h * cards)
        hand_cols = take((p - 1) * h * cards)
        for o in range(p):
            for k in range(1, p):
                hand_cols[:, o, (k - 1) * h * cards : k * h * cards] = hand_bits[:, seat[o][k]]
        short = s["hand_count"] < h  # [B, P] by seat
        take(p).copy_(short[:, self._seat_table])

        # the board, the discards and the last move's game-wide parts: written for observer 0
        # and copied to the others
        game_from = at
        left = r.deck_size - s["dealt"]
        torch.lt(self._deck_bits, left[:, None], out=take(self._deck_bits.numel())[:, 0])
        fireworks = take(cards)[:, 0].unflatten(1, (c, rk))
        torch.eq(s["fireworks"][:, :, None] - 1, self._rank_ids, out=fireworks)
        torch.lt(self._info_bits, s["info"][:, None], out=take(r.max_information_tokens)[:, 0])
        torch.lt(self._life_bits, s["life"][:, None], out=take(r.max_life_tokens)[:, 0])
        discards = s["discards"].index_select(1, self._discard_card)
        torch.gt(discards, self._discard_copy, out=take(r.deck_size)[:, 0])

        kind = s["last_kind"]
        has = kind >= 0
        hint = (kind == REVEAL_COLOR) | (kind == REVEAL_RANK)
        leave = (kind == PLAY) | (kind == DISCARD)
        # The mover and the hint's target relative to each observer, then the game-wide
        # fields; a field this kind of move does not encode becomes -1, whose one-hot is empty.
        observers = self._seat_ids[:, None]  # [P, 1]
        board_to = at
        actor_cols = take(p)
        torch.eq((s["last_player"][:, None, None] - observers) % p, self._seat_ids, out=actor_cols)
        actor_cols &= has[:, None, None]
        kind_from = at
        torch.eq(kind[:, None], self._kind_ids, out=take(4)[:, 0])  # -1 (no move): all zero
        kind_to = at
        target_cols = take(p)
        torch.eq((s["last_target"][:, None, None] - observers) % p, self._seat_ids, out=target_cols)
        target_cols &= hint[:, None, None]
        after_target = at
        color = torch.where(kind == REVEAL_COLOR, s["last_color"], -1)
        torch.eq(color[:, None], self._color_ids, out=take(c)[:, 0])
        rank = torch.where(kind == REVEAL_RANK, s["last_rank"], -1)
        torch.eq(rank[:, None], self._rank_ids, out=take(rk)[:, 0])
        torch.logical_and(s["last_revealed"], hint[:, None], out=take(h)[:, 0])
        torch.eq(torch.where(leave, s["last_slot"], -1)[:, None], self._slots, out=take(h)[:, 0])
        torch.eq(
            torch.where(leave, s["last_card"], -1)[:, None], self._card_ids, out=take(cards)[:, 0]
        )
        play = kind == PLAY
        # the HLE sets the token bit for plays only (a discard's token is not encoded)
        torch.logical_and(s["last_scored"], play, out=take(1)[:, 0, 0])
        torch.logical_and(s["last_token"], play, out=take(1)[:, 0, 0])
        game_to = at
        for lo, hi in ((game_from, board_to), (kind_from, kind_to), (after_target, game_to)):
            out[:, 1:, lo:hi] = out[:, :1, lo:hi]

        # every holder's card knowledge, once per holder (a table row per slot), then placed
        # from each seat on
        per_slot = cards + c + rk
        # the row's code as a product with the bits' weights (exact in float32: < 2^24)
        code = as_float(s["color_ok"].flatten(0, 2)) @ self._color_weights
        code += as_float(s["rank_ok"].flatten(0, 2)) @ self._rank_weights
        code = code.long() + (s["color_hint"].flatten() + 1) * (rk + 1)
        code += s["rank_hint"].flatten() + 1
        know = self._knowledge_table.index_select(0, code).view(b, p, h, per_slot)
        if paper_belief:
            know[..., :cards] = self.paper_belief(know[..., :cards])
        know_cols = take(p * h * per_slot)
        block = h * per_slot
        for o in range(p):
            for k in range(p):
                know_cols[:, o, k * block : (k + 1) * block] = know[:, seat[o][k]].view(b, block)
        assert at == r.observation_size
        return out

    def views(
        self, paper: bool, ids: Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What the env returns, from the native backend in one pass over the games (or over
        games ``ids [K]``): every player's observation ``[B, P, n]`` (``n`` the observation
        size, plus ``P`` for the paper's turn one-hot), the global state ``[B, n + H*C*R]``
        (the acting player's observation and own hand; the hand first with ``paper``), both
        0/1 in ``dtype`` (float32 or uint8), the action masks ``[B, P, M]`` bool (the legal
        moves for the player to act, move 0 alone for the others and in a finished game) and
        who acts ``[B, P]`` bool. See :class:`~mappo.envs.hanabi.env.HanabiEnv` for the torch
        form of each."""
        if self.native is None:
            raise RuntimeError("HanabiGames.views needs the native backend")
        r = self.rules
        rows = self.batch if ids is None else int(ids.numel())
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
        n = r.observation_size + (r.players if paper else 0)
        if (
            ids is not None
            and ids.numel()
            and not 0 <= int(ids.min()) <= int(ids.max()) < self.batch
        ):
            raise IndexError(f"game ids must lie in [0, {self.batch})")
        if dtype not in (torch.float32, torch.uint8):
            raise ValueError(f"views are float32 or uint8, not {dtype}")
        cpu = "cpu"
        obs = torch.empty(rows, r.players, n, dtype=dtype, device=cpu)
        state = torch.empty(rows, n + r.hand * r.colors * r.ranks, dtype=dtype, device=cpu)
        mask = torch.empty(rows, r.players, r.num_moves, dtype=torch.bool, device=cpu)
        alive = torch.empty(rows, r.players, dtype=torch.bool, device=cpu)
        self.native.run(
            "hanabi_views",
            self.state,
            rows,
            ids,
            int(paper),
            int(dtype == torch.uint8),
            obs.data_ptr(),
            state.data_ptr(),
            mask.data_ptr(),
            alive.data_ptr(),
        )
        return obs, state, mask, alive

    def paper_belief(self, plausible: Tensor) -> Tensor:
        """The MAPPO paper code's replacement of the plausible-card bits (``plausible [B, P, H,
        C*R]`` bool, per holder's slot) by its "V0 belief" section.

        Its Hanabi library (a copy of the HLE vendored in the paper's repository,
        ``onpolicy/envs/hanabi/hanabi_lib/canonical_encoders.cc``, ``EncodeV0Belief_``)
        multiplies each plausible card by the copies of it not yet discarded or played, and
        divides by their sum over the slot, in an integer vector: the quotient truncates to 1
        where one card is the only plausible one left with copies, and to 0 everywhere else. So
        a slot's 25 bits are the one-hot of its card where hints and the public counts (not the
        other hands) determine it, and all zero otherwise. Same length as the canonical section;
        the revealed color and rank bits are unchanged.
        """
        s = self.state
        played = (self._rank_ids < s["fireworks"][:, :, None]).reshape(s["fireworks"].shape[0], -1)
        left = self.card_counts - s["discards"] - played.long()  # [B, C*R] copies not public
        weight = plausible.long() * left[:, None, None, :]
        total = weight.sum(-1, keepdim=True)
        return (weight == total) & (total > 0)


BACKENDS = ("auto", "torch", "native")


def _native_backend(rules: HanabiRules, device: torch.device, backend: str):
    """The native backend for these rules and this device, or ``None`` for torch; raises
    ``ValueError`` for an unknown ``backend`` or a ``"native"`` that cannot be had."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return None
    from mappo.envs.hanabi import native

    why = None
    if device.type != "cpu":
        why = f"it runs on the CPU only (the games are on {device})"
    elif not native.fits(rules):
        why = (
            f"its buffers hold at most {native.MAX_PLAYERS} players, {native.MAX_HAND} cards a "
            f"hand and {native.MAX_MOVES} moves"
        )
    else:
        lib = native.library(rules)
        if lib is not None:
            return native.NativeGames(lib, rules)
        why = f"it could not be built: {native.unavailable_reason()}"
        if backend != "native":
            native.native_build.note_fallback(
                "Hanabi's C step",
                str(native.unavailable_reason()),
                "the games step in torch, several times slower",
            )
    if backend == "native":
        raise ValueError(f"backend='native' is not available: {why}; use backend='torch'")
    return None


def as_float(flags: Tensor) -> Tensor:
    """``flags`` (bool) as float32 0/1, through bytes: converting bytes to floats is
    vectorised, converting bools is about ten times slower on a CPU."""
    return flags.view(torch.uint8).float()
