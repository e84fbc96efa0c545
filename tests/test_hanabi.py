"""Hanabi against OpenSpiel's (the Hanabi Learning Environment's) game, move by move, and the
rules that matter most checked on hand-made decks.

``pytest -k hanabi_exact`` runs the comparison; ``MAPPO_HANABI_SEED`` and ``MAPPO_HANABI_GAMES``
choose its base seed and its number of games per variant, so the same test runs on games the
project has never seen.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mappo.envs import ActionError, EnvError, make
from mappo.envs.hanabi import HanabiEnv
from mappo.envs.hanabi.game import HanabiGames, HanabiRules


def _env_int(name: str, default: int, low: int) -> int:
    """A whole number of at least ``low`` from the environment variable ``name``: a typo stops
    the run in one line instead of a collection traceback, and 0 games cannot pass vacuously."""
    text = os.environ.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        raise pytest.UsageError(f"{name} must be a whole number, got {text!r}") from None
    if value < low:
        raise pytest.UsageError(f"{name} must be at least {low}, got {value}")
    return value


SEED = _env_int("MAPPO_HANABI_SEED", 0, 0)
GAMES = _env_int("MAPPO_HANABI_GAMES", 1000, 1)
BACKEND = os.environ.get("MAPPO_HANABI_BACKEND", "auto")
"""The games' backend in the comparison with OpenSpiel (``auto``: the C code on a CPU where it
builds; ``torch``: the tensor code, as on a GPU). Each is also checked against the other below."""

VARIANTS = [
    {"players": 2},
    {"players": 3},
    {"players": 4},
    {"players": 5},
    # the small game: 2 colors, 3 ranks, 3 cards, 3 information tokens, 1 life
    {
        "players": 2,
        "colors": 2,
        "ranks": 3,
        "hand_size": 3,
        "max_information_tokens": 3,
        "max_life_tokens": 1,
    },
]


def _open_spiel_game(rules: HanabiRules):
    # open_spiel is in the test extra (CI installs it); only this comparison needs it.
    pyspiel = pytest.importorskip("pyspiel", reason="open_spiel is a test dependency (mappo[test])")
    return pyspiel.load_game(
        "hanabi",
        {
            "players": rules.players,
            "colors": rules.colors,
            "ranks": rules.ranks,
            "hand_size": rules.hand,
            "max_information_tokens": rules.max_information_tokens,
            "max_life_tokens": rules.max_life_tokens,
        },
    )


def _choose(rules: HanabiRules, games: HanabiGames, b: int, legal: list[int], rng) -> int:
    """A random legal move: in every fourth game any legal move (these games mostly end by
    misplays), in the others one that mostly avoids misplays (it peeks at the cards), so that
    games run long: the deck runs out, fireworks complete, top-rank plays return tokens."""
    if b % 4 == 0:
        return int(rng.choice(legal))
    h, s = rules.hand, games.state
    me = int(s["player"][b])

    def fits(move: int) -> bool:
        card = int(s["hands"][b, me, move - h])
        return int(s["fireworks"][b, card // rules.ranks]) == card % rules.ranks

    safe = [m for m in legal if not (h <= m < 2 * h) or fits(m)]
    plays = [m for m in safe if h <= m < 2 * h]
    if plays and rng.random() < 0.7:
        return int(rng.choice(plays))
    return int(rng.choice(safe if safe and rng.random() < 0.97 else legal))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}{v[k]}" for k in v))
def test_hanabi_exact(variant):
    """With the same deck order dealt to OpenSpiel's game and ours, and the same moves, every
    player to act, legal-move set, observation of every player, reward, end of game and final
    score agree, over ``MAPPO_HANABI_GAMES`` games."""
    rules = HanabiRules(**variant)
    game = _open_spiel_game(rules)
    assert game.observation_tensor_shape() == [rules.observation_size]
    assert game.num_distinct_actions() == rules.num_moves
    seed = SEED * 1000 + rules.players * 10 + rules.colors
    ours = HanabiGames(rules, GAMES, backend=BACKEND)
    decks = ours.shuffled_decks(torch.Generator().manual_seed(seed))
    ours.reset(decks)
    rng = np.random.default_rng(seed)
    theirs, dealt = [], []
    for b in range(GAMES):
        st, i = game.new_initial_state(), 0
        while st.is_chance_node():
            st.apply_action(int(decks[b, i]))
            i += 1
        theirs.append(st)
        dealt.append(i)
    step = 0
    while not all(st.is_terminal() for st in theirs):
        legal = ours.legal_moves()
        views = [ours.observe(torch.full((GAMES,), q)).numpy() for q in range(rules.players)]
        moves = torch.zeros(GAMES, dtype=torch.int64)
        for b, st in enumerate(theirs):
            over = bool(ours.state["over"][b])
            assert over == st.is_terminal(), f"game {b} step {step}: over={over}\n{st}"
            if over:
                continue
            assert int(ours.state["player"][b]) == st.current_player(), f"game {b} step {step}"
            want = st.legal_actions()
            assert torch.nonzero(legal[b]).flatten().tolist() == want, f"game {b} step {step}"
            for q in range(rules.players):
                np.testing.assert_array_equal(
                    views[q][b],
                    np.asarray(st.observation_tensor(q), dtype=np.float32),
                    err_msg=f"game {b} step {step} observer {q}\n{st}",
                )
            moves[b] = _choose(rules, ours, b, want, rng)
        rewards = ours.step(moves)
        for b, st in enumerate(theirs):
            if st.is_terminal():
                continue
            before = st.returns()[0]
            st.apply_action(int(moves[b]))
            while st.is_chance_node():
                st.apply_action(int(decks[b, dealt[b]]))
                dealt[b] += 1
            assert float(rewards[b]) == st.returns()[0] - before, f"game {b} step {step}"
        step += 1
    assert bool(ours.state["over"].all())
    finals = torch.tensor([st.returns()[0] for st in theirs])
    # the returns sum the rewards, so they end at the final score (0 after the last life)
    torch.testing.assert_close(ours.score().float(), finals)
    # the random policy reaches the endings: lives lost and the deck run out (perfect fireworks
    # too in some variants, at 1,000 games)
    if GAMES >= 200:
        lost = ours.state["life"] == 0
        assert lost.any() and (~lost & (ours.state["dealt"] == rules.deck_size)).any()


def _games(deck: list[int], **rules) -> HanabiGames:
    g = HanabiGames(HanabiRules(**rules), 1)
    g.reset(torch.tensor([deck]))
    return g


def test_deck_injection_deals_the_deck_in_order():
    """The hands are the deck's first cards, player 0's first; draws continue from there."""
    rules = HanabiRules(players=3)
    g = HanabiGames(rules, 2)
    decks = g.shuffled_decks(torch.Generator().manual_seed(3))
    g.reset(decks)
    h = rules.hand
    assert torch.equal(g.state["hands"], decks[:, : 3 * h].reshape(2, 3, h))
    # player 0 plays slot 0: the next deck card lands in the last slot
    g.step(torch.tensor([h, h]))
    assert torch.equal(g.state["hands"][:, 0, -1], decks[:, 3 * h])
    assert torch.equal(g.state["hands"][:, 0, :-1], decks[:, 1:h])
    # every shuffled deck holds each card as often as the rules say
    for d in decks:
        assert torch.equal(torch.bincount(d, minlength=25), g.card_counts)


@pytest.mark.parametrize("reset_first", [True, False])
def test_the_step_after_a_deal_is_checked_against_the_dealt_games_masks(reset_first):
    """A deal starts new games: its masks, not the previous reset's (or none on a fresh env),
    are what the next checked step allows."""
    env = make("hanabi/full-2p", num_envs=1, seed=0)
    deck = [c for c, n in enumerate(env.games.card_counts.tolist()) for _ in range(n)]
    if reset_first:
        env.reset()
    step = env.deal(torch.tensor([deck]))
    allowed = step.action_mask["players"][0, 0]
    legal, illegal = int(allowed.nonzero()[-1]), int((~allowed).nonzero()[-1])
    action = torch.zeros(1, 2, 1, dtype=torch.long)
    action[0, 0, 0] = illegal
    with pytest.raises(ActionError, match="not allowed by its action mask"):
        env.step({"players": action})
    action[0, 0, 0] = legal
    env.step({"players": action})


def test_masks_forbid_what_the_rules_forbid():
    # 2 players, 5 colors, 5 ranks: player 1 holds only red (color 0) cards of ranks 0-1
    red = [0, 0, 0, 1, 1]
    deck = [5, 6, 7, 10, 11] + red + list(range(12, 25)) * 2
    g = _games(deck[:50], players=2)
    legal = g.legal_moves()[0]
    h = 5
    # full information tokens: no discard; every held card may be played
    assert not legal[:h].any() and legal[h : 2 * h].all()
    # hints to the other player: only the color red and the ranks 1 and 2 touch a card
    colors, ranks = legal[2 * h : 2 * h + 5], legal[2 * h + 5 :]
    assert colors.tolist() == [True, False, False, False, False]
    assert ranks.tolist() == [True, True, False, False, False]
    # out of information tokens: no hint at all
    g.state["info"][0] = 0
    legal = g.legal_moves()[0]
    assert not legal[2 * h :].any() and legal[:h].all()


def test_the_last_life_ends_the_game_at_score_zero():
    # 2 players, 1 life: player 0 plays a card that fits (score 1), then player 1 misplays
    g = _games([0, 1, 2, 3, 4] + [2, 2, 3, 3, 4] + [0] * 40, players=2, max_life_tokens=1)
    assert g.step(torch.tensor([5])).item() == 1.0  # play slot 0: red 1 fits
    assert g.step(torch.tensor([5])).item() == -1.0  # red 3 misplayed: score drops to 0
    assert bool(g.state["over"][0]) and g.score().item() == 0
    # a finished game ignores further moves
    assert g.step(torch.tensor([5])).item() == 0.0 and g.state["life"].item() == 0


def test_perfect_fireworks_end_the_game():
    # one color, one rank: three copies; the first play completes the fireworks
    g = _games([0, 0, 0], players=2, colors=1, ranks=1, hand_size=1)
    assert g.step(torch.tensor([1])).item() == 1.0
    assert bool(g.state["over"][0]) and g.score().item() == 1


def test_an_empty_deck_gives_every_player_one_more_move():
    # one color, two ranks (3 + 1 cards), 2 players of 1 card: 2 cards left in the deck
    g = _games([0, 0, 0, 1], players=2, colors=1, ranks=2, hand_size=1, max_information_tokens=3)
    g.state["info"][0] = 0
    moves = [0, 0]  # discard, discard: the deck is empty after the second draw
    for m in moves:
        g.step(torch.tensor([m]))
        assert not bool(g.state["over"][0])
    g.step(torch.tensor([0]))  # player 0's last move
    assert not bool(g.state["over"][0])
    g.step(torch.tensor([0]))  # player 1's last move ends the game
    assert bool(g.state["over"][0])


def test_a_batch_equals_its_games_played_alone():
    rules = HanabiRules(players=3)
    batch = HanabiGames(rules, 6)
    decks = batch.shuffled_decks(torch.Generator().manual_seed(5))
    batch.reset(decks)
    alone = []
    for b in range(6):
        g = HanabiGames(rules, 1)
        g.reset(decks[b : b + 1])
        alone.append(g)
    rng = np.random.default_rng(1)
    for _ in range(40):
        legal = batch.legal_moves()
        moves = torch.tensor(
            [
                int(rng.choice(torch.nonzero(row).flatten().tolist())) if row.any() else 0
                for row in legal
            ]
        )
        rewards = batch.step(moves)
        obs = batch.observe(batch.state["player"])
        for b, g in enumerate(alone):
            assert g.step(moves[b : b + 1]).item() == rewards[b].item()
            assert torch.equal(g.observe(g.state["player"])[0], obs[b])
            for k, v in g.state.items():
                assert torch.equal(v[0], batch.state[k][b]), k


# -- the native (C) backend against the torch one -------------------------------------------------


def _native_or_skip() -> None:
    from mappo.envs.hanabi import native

    # no C compiler: the games step in torch (tested throughout)
    if native.library(HanabiRules()) is None:
        pytest.skip(f"the native backend cannot be built here: {native.unavailable_reason()}")


@pytest.mark.parametrize("threads", ["1", "2", "2 of our own"])
@pytest.mark.parametrize("variant", [*VARIANTS, {"players": 2, "colors": 1, "hand_size": 2}])
def test_native_games_equal_torch_games(variant, threads, monkeypatch):
    """The C step, legal moves, observations (canonical and the paper's belief) and deals leave
    every state tensor, reward and view exactly as the torch code does, over random games with a
    sprinkling of illegal moves (what the step does with those is part of the state too); 600
    games, so that two threads split them: torch's OpenMP threads where the library shares them,
    and threads of our own (the build for a torch without libgomp)."""
    _native_or_skip()
    from mappo.envs.hanabi import native

    if threads == "2 of our own":
        monkeypatch.setattr(native, "_torch_uses_libgomp", lambda: False)
        monkeypatch.setattr(native, "_libraries", {})
    rules = HanabiRules(**variant)
    n = 600
    plain = HanabiGames(rules, n, backend="torch")
    fast = HanabiGames(rules, n, backend="native")
    assert plain.native is None and fast.native is not None
    if threads == "2 of our own":
        assert not fast.native._openmp
    threads = int(threads[0])
    decks = plain.shuffled_decks(torch.Generator().manual_seed(1))
    plain.reset(decks)
    fast.reset(decks)
    gen = torch.Generator().manual_seed(2)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ended = 0
        for t in range(120):
            legal = plain.legal_moves()
            assert torch.equal(fast.legal_moves(), legal), f"step {t}"
            for belief in (False, True):
                want = plain.observe_all(paper_belief=belief)
                assert torch.equal(fast.observe_all(paper_belief=belief), want), f"step {t}"
            weights = legal.float() + (0.02 if t % 3 == 0 else 0.0)  # illegal moves now and then
            weights[weights.sum(1) == 0] = 1
            moves = torch.multinomial(weights, 1, generator=gen).squeeze(1)
            assert torch.equal(fast.step(moves), plain.step(moves)), f"step {t}"
            for k, v in plain.state.items():
                assert torch.equal(fast.state[k], v), f"step {t}: {k}"
            done = plain.state["over"]
            if bool(done.any()):
                ids = done.nonzero().squeeze(1)
                fresh = plain.shuffled_decks(gen, ids.numel())
                plain.reset_games(ids, fresh)
                fast.reset_games(ids, fresh)
                ended += ids.numel()
                for k, v in plain.state.items():
                    assert torch.equal(fast.state[k], v), f"step {t}, after the deals: {k}"
        assert ended > 0
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("variant", [{}, {"players": 3, "colors": 2, "ranks": 3, "hand_size": 3}])
def test_native_decks_are_torchs_decks_ties_included(variant):
    """The C shuffle gives the decks torch's stable argsort of the same uniform keys gives, also
    where keys are equal (rare in practice: about one deck in 13,000); a fresh deal of chosen
    games in one C pass is what dealing the decks drawn from the same generator does."""
    _native_or_skip()
    rules = HanabiRules(**variant)
    plain = HanabiGames(rules, 300, backend="torch")
    fast = HanabiGames(rules, 300, backend="native")
    d = rules.deck_size
    for seed in range(3):
        want = plain.shuffled_decks(torch.Generator().manual_seed(seed))
        assert torch.equal(fast.shuffled_decks(torch.Generator().manual_seed(seed)), want)
        assert torch.equal(want.sort(1).values, plain.sorted_deck.expand(300, d))
    # keys drawn from four values: every deck full of ties, broken by position
    keys = torch.randint(0, 4, (300, d), generator=torch.Generator().manual_seed(9)) / 4
    decks = torch.empty(300, d, dtype=torch.int64)
    fast.native.run("hanabi_shuffle", None, 300, None, 0, keys.data_ptr(), decks.data_ptr())
    assert torch.equal(decks, plain.sorted_deck[keys.argsort(dim=1, stable=True)])
    # dealing chosen games afresh
    start = plain.shuffled_decks(torch.Generator().manual_seed(5))
    plain.reset(start)
    fast.reset(start)
    ids = torch.tensor([0, 7, 8, 150, 299])
    plain.deal_shuffled(ids, torch.Generator().manual_seed(6))
    fast.deal_shuffled(ids, torch.Generator().manual_seed(6))
    for k, v in plain.state.items():
        assert torch.equal(fast.state[k], v), k
    assert not torch.equal(fast.state["deck"][ids], start[ids])
    assert torch.equal(fast.state["deck"][1:7], start[1:7])
    with pytest.raises(IndexError, match="game ids must lie in"):
        fast.deal_shuffled(torch.tensor([300]))
    with pytest.raises(IndexError, match="game ids must lie in"):
        fast.deal_shuffled(torch.tensor([-301]))
    # negative ids count from the end, as in reset_games and torch's indexing
    plain.deal_shuffled(torch.tensor([-1, -300]), torch.Generator().manual_seed(7))
    fast.deal_shuffled(torch.tensor([-1, -300]), torch.Generator().manual_seed(7))
    for k, v in plain.state.items():
        assert torch.equal(fast.state[k], v), k
    # the keys are float32 whatever torch's default dtype (the C sort reads them as such)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        want = plain.shuffled_decks(torch.Generator().manual_seed(8))
        assert torch.equal(fast.shuffled_decks(torch.Generator().manual_seed(8)), want)
    finally:
        torch.set_default_dtype(previous)


def test_the_native_env_step_refuses_counters_it_cannot_write():
    """The one-pass step writes its length and move counters in place: tensors of another
    dtype or shape are refused rather than written past."""
    _native_or_skip()
    games = HanabiGames(HanabiRules(), 4, backend="native")
    games.reset(games.shuffled_decks(torch.Generator().manual_seed(0)))
    acts = torch.zeros(4, 2, dtype=torch.int64)
    length, counts = torch.zeros(4, dtype=torch.int64), torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="length must be a contiguous int64"):
        games.env_step(acts, length.int(), counts)
    with pytest.raises(ValueError, match="counts must be a contiguous int64"):
        games.env_step(acts, length, torch.zeros(4, 2, dtype=torch.int64))
    rewards, stats = games.env_step(acts, length, counts)
    assert rewards.shape == (4, 2) and stats.shape == (7, 4)
    assert length.tolist() == [1] * 4 and counts[:, 0].tolist() == [1] * 4  # four discards


@pytest.mark.parametrize("observation", ["canonical", "paper"])
@pytest.mark.parametrize("name", ["hanabi/full-2p", "hanabi/full-3p", "hanabi/small-2p"])
def test_native_env_steps_equal_torch_env_steps(name, observation):
    """The env on the C backend returns what it returns on torch: observations, global states,
    rewards, ends, masks, who acts, the final views of the games that ended and the statistics;
    with its views as bytes (the default) or float32, the same values."""
    _native_or_skip()
    n = 96
    envs = {
        (backend, dtype): make(
            name, num_envs=n, seed=3, observation=observation, backend=backend, dtype=dtype
        )
        for backend in ("torch", "native")
        for dtype in ("uint8", "float32")
    }
    steps = {key: env.reset() for key, env in envs.items()}
    gen = torch.Generator().manual_seed(0)

    def same(a, b, where: str, dtype: torch.dtype | None = None) -> None:
        if isinstance(a, torch.Tensor):
            if dtype is not None:
                assert b.dtype == dtype, where
                a, b = a.float(), b.float()
            assert torch.equal(a, b), where
        elif a is None:
            assert b is None, where
        else:
            assert set(a) == set(b), where
            for k in a:
                same(a[k], b[k], f"{where}/{k}", dtype)

    ended = 0
    views = ("obs", "state", "final_obs", "final_state")
    fields = (*views, "reward", "terminated", "truncated", "alive", "stats", "action_mask")
    for t in range(120):
        sp = steps["torch", "uint8"]
        for (backend, dtype), sf in steps.items():
            for field in (*fields, "final_action_mask"):
                where = f"step {t} {backend} {dtype} {field}"
                view_dtype = getattr(torch, dtype) if field in views else None
                same(getattr(sp, field), getattr(sf, field), where, view_dtype)
        ended += int(sp.terminated.sum())
        acts = _random_actions(sp, gen)
        steps = {key: env.step(acts) for key, env in envs.items()}
    assert ended > 0


def test_backends_are_chosen_and_refused_in_one_line(monkeypatch, tmp_path):
    """``auto`` takes the C code on a CPU and torch on a GPU; an unknown backend, ``native`` on
    a GPU and ``native`` without a C compiler are refused naming the fix, and ``auto`` then
    falls back to torch."""
    from mappo.envs.hanabi import game as game_module
    from mappo.envs.hanabi import native

    rules = HanabiRules()
    with pytest.raises(EnvError, match="backend must be one of auto, torch, native"):
        make("hanabi/full-2p", num_envs=1, backend="fast")
    with pytest.raises(EnvError, match="dtype must be one of float32, uint8"):
        make("hanabi/full-2p", num_envs=1, dtype="float16")
    with pytest.raises(ValueError, match="CPU only.*use backend='torch'"):
        game_module._native_backend(rules, torch.device("cuda"), "native")
    assert game_module._native_backend(rules, torch.device("cuda"), "auto") is None
    # no compiler: a fresh process's first build fails
    monkeypatch.setattr(native, "_libraries", {})
    monkeypatch.setattr(native, "_reason", None)
    monkeypatch.setenv("MAPPO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native.native_build, "_noted", set())
    with pytest.warns(RuntimeWarning, match="Hanabi's C step could not be built"):
        assert make("hanabi/full-2p", num_envs=2, backend="auto").games.native is None
    with pytest.raises(EnvError, match="could not be built: no C compiler found"):
        make("hanabi/full-2p", num_envs=2, backend="native")
    assert not list(tmp_path.rglob("*.so"))


def test_the_native_library_is_built_once_into_the_cache(monkeypatch, tmp_path):
    """The C file compiles into ``$MAPPO_CACHE_DIR/native`` under a name made of its hash (of the
    source and the build, the variant's sizes included); a second process finds it there (no
    second build)."""
    _native_or_skip()
    from mappo import native_build
    from mappo.envs.hanabi import native

    monkeypatch.setenv("MAPPO_CACHE_DIR", str(tmp_path))
    sizes = native._sizes(HanabiRules())
    first = native._compile(sizes)
    assert first.parent == tmp_path / "native" and first.name.startswith("hanabi-")
    stamp = first.stat().st_mtime_ns
    assert native._compile(sizes) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "native").iterdir()] == [first.name]  # no leftovers
    # another variant (its sizes compiled in) is another file
    other = native._compile(native._sizes(HanabiRules(players=3)))
    assert other.parent == first.parent and other != first
    # a cache others can write into is not trusted: the library goes to a folder of the user's
    # own in the temporary directory instead
    shared = tmp_path / "shared"
    (shared / "native").mkdir(parents=True)
    (shared / "native").chmod(0o777)
    monkeypatch.setenv("MAPPO_CACHE_DIR", str(shared))
    monkeypatch.setattr(native_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    own = native._compile(sizes)
    assert own.parent == tmp_path / "tmp" / f"mappo-{os.getuid()}"
    assert not list((shared / "native").iterdir())


def test_native_games_refuse_what_would_write_past_them(monkeypatch):
    """Inputs the C code would turn into reads or writes past the state's memory are refused
    in Python (the torch backend raises for most of them too): moves of the wrong shape, game
    ids out of range, decks of the wrong shape or with unknown cards. Negative ids count from
    the end, as torch's indexing does. The views keep float32 on the CPU whatever torch's
    defaults, and a tensor whose storage moved (``set_``) is read again."""
    _native_or_skip()
    rules = HanabiRules()
    games = HanabiGames(rules, 4, backend="native")
    decks = games.shuffled_decks(torch.Generator().manual_seed(0))
    games.reset(decks)
    with pytest.raises(ValueError, match="moves must be"):
        games.step(torch.tensor(5))
    with pytest.raises(IndexError, match="must lie in"):
        games.reset_games(torch.tensor([4]), decks[:1])
    with pytest.raises(ValueError, match="decks must be"):
        games.reset_games(torch.tensor([0]), decks)
    bad = decks[:1].clone()
    bad[0, 0] = 1000
    with pytest.raises(ValueError, match="card ids"):
        games.reset_games(torch.tensor([0]), bad)
    with pytest.raises(ValueError, match="card ids"):
        games.reset(decks - 1)
    games.reset_games(torch.tensor([-1]), decks[:1])  # the last game
    assert torch.equal(games.state["deck"][3], decks[0])
    with pytest.raises(RuntimeError):  # too narrow: the torch code's own error, nothing written
        games.observe_all(out=torch.zeros(4, 2, 10, dtype=torch.bool))
    plain = HanabiGames(rules, 4, backend="torch")
    plain.reset(games.state["deck"])
    monkeypatch.setattr(torch, "get_default_dtype", lambda: torch.float64)
    torch.set_default_dtype(torch.float64)
    try:
        obs, state, _, _ = games.views(paper=False)
    finally:
        torch.set_default_dtype(torch.float32)
    assert obs.dtype == state.dtype == torch.float32
    assert torch.equal(obs, plain.observe_all().view(torch.uint8).float())
    moved = games.state["info"].clone()
    games.state["info"].set_(moved.untyped_storage().__class__(8 * 4), 0, (4,))
    games.state["info"].copy_(moved)
    games.step(torch.zeros(4, dtype=torch.int64))  # discards at full tokens: no token added
    assert torch.equal(games.state["info"], moved)


def test_the_native_library_shares_torchs_openmp_threads():
    """Where torch's OpenMP runtime is libgomp (its Linux wheels) and the compiler takes
    ``-fopenmp``, the library is built with it and splits rows between torch's own threads: one
    OpenMP runtime in the process, not a second set of threads."""
    _native_or_skip()
    from mappo.envs.hanabi import native

    if not native._torch_uses_libgomp():
        pytest.skip("torch's OpenMP runtime here is not libgomp")
    try:
        native._compile(native._sizes(HanabiRules()), openmp=True)
    except RuntimeError as err:
        pytest.skip(f"the compiler does not build OpenMP code here: {err}")
    games = HanabiGames(HanabiRules(), 600, backend="native")
    assert games.native._openmp
    with open("/proc/self/maps", encoding="utf-8") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


@pytest.mark.parametrize("threads", ["torch's", "our own"])
def test_native_games_copy_and_survive_a_fork(threads, monkeypatch):
    """An env on the native backend deep-copies and pickles (the copy binds the library again,
    with its own pointers), and a forked child steps it with two threads asked for: neither
    torch's OpenMP team nor the parent's thread pool (the build for a torch without libgomp)
    is inherited, so the child steps on one thread."""
    _native_or_skip()
    from mappo.envs.hanabi import native

    if threads == "our own":
        monkeypatch.setattr(native, "_torch_uses_libgomp", lambda: False)
        monkeypatch.setattr(native, "_libraries", {})
    import copy
    import multiprocessing
    import pickle

    env = make("hanabi/full-2p", num_envs=600, seed=1)
    first = env.reset()
    twin = copy.deepcopy(env)
    assert twin.games.native is not None and twin.games.native is not env.games.native
    again = pickle.loads(pickle.dumps(env))
    acts = _random_actions(first, torch.Generator().manual_seed(0))
    a, b, c = env.step(acts), twin.step(acts), again.step(acts)
    assert torch.equal(a.obs["players"], b.obs["players"])
    assert torch.equal(a.obs["players"], c.obs["players"])
    # A forked child, with the parent's pool of threads made by a two-thread call. (Only the C
    # calls in the child: torch's own OpenMP threads do not survive a fork either, so its
    # multi-threaded operations hang in a child; that is torch's rule, not ours.)
    games = HanabiGames(HanabiRules(), 600, backend="native")
    games.reset(games.shuffled_decks(torch.Generator().manual_seed(3)))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        games.legal_moves()  # torch's team, or the pool of ours, exists now
        assert games.native._openmp == (threads == "torch's" and native._torch_uses_libgomp())
        child = multiprocessing.get_context("fork").Process(target=_native_calls, args=(games,))
        child.start()
        child.join(60)
        if child.exitcode is None:
            child.kill()
        assert child.exitcode == 0, "the forked child did not finish its calls"
    finally:
        torch.set_num_threads(previous)


def _native_calls(games: HanabiGames) -> None:
    legal = games.legal_moves()
    games.step(legal.int().argmax(1))


def test_a_compiler_given_with_arguments_builds(monkeypatch, tmp_path):
    """``CC="ccache gcc"`` style: the first word is the program, the rest its arguments."""
    _native_or_skip()
    import shutil

    from mappo.envs.hanabi import native

    cc = shutil.which("cc")
    monkeypatch.setenv("MAPPO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", f"{cc} -O2")
    assert native._compile(native._sizes(HanabiRules())).exists()


# -- the env: turn-based play in the batched contract -------------------------------------------


def _random_actions(step, gen: torch.Generator) -> dict[str, torch.Tensor]:
    mask = step.action_mask["players"].float()
    e, p, m = mask.shape
    acts = torch.multinomial(mask.reshape(-1, m), 1, generator=gen).reshape(e, p, 1)
    return {"players": acts}


def test_only_the_player_to_act_moves():
    """One player acts per step: only it is alive, the others may only 'move 0' and whatever
    they send is ignored; everyone gets the score change."""
    a, b = make("hanabi/full-3p", num_envs=8, seed=4), make("hanabi/full-3p", num_envs=8, seed=4)
    sa, sb = a.reset(), b.reset()
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        me = a.games.state["player"]
        alive = sa.alive["players"]
        assert torch.equal(alive, torch.nn.functional.one_hot(me, 3).bool())
        idle = sa.action_mask["players"][~alive]
        assert idle[:, 0].all() and not idle[:, 1:].any()
        acts = _random_actions(sa, gen)["players"]
        other = acts.clone()
        other[~alive] = 0  # the idle players' 'move 0' instead of whatever they sent
        a.validate_actions = False  # the idle players' random moves break their masks
        sa, sb = a.step({"players": acts}), b.step({"players": other})
        assert torch.equal(sa.obs["players"], sb.obs["players"])
        r = sa.reward["players"]
        assert torch.equal(r, r[:, :1].expand_as(r))
    # each player's observation is its own: the hands section shows the others' cards
    obs = sa.obs["players"]
    assert not torch.equal(obs[:, 0], obs[:, 1])


@pytest.mark.parametrize("sync_free", [False, True], ids=["cpu-path", "gpu-path"])
def test_episodes_end_reset_and_report_their_score(sync_free):
    """Auto-reset with final views and episode statistics, on the CPU's path and on the GPU's
    (no host sync: every game draws a deck, the unfinished keep theirs), run here on the CPU."""
    env = make("hanabi/full-2p", num_envs=16, seed=2)
    env._sync_free = sync_free
    twin = make("hanabi/full-2p", num_envs=16, seed=2)  # the same moves without the reset
    twin.reset()
    step = env.reset()
    gen = torch.Generator().manual_seed(1)
    ended = 0
    for _ in range(200):
        before = env.games.score().clone()
        decks = env.games.state["deck"].clone()
        twin.set_state(env.get_state())
        actions = _random_actions(step, gen)
        step = env.step(actions)
        done = step.terminated
        # final_* hold every game's views before the reset (the running games' equal obs)
        player = twin.games.state["player"][:, None]
        twin.games.step(actions["players"].reshape(16, 2).gather(1, player).squeeze(1))
        final_obs, final_state, final_mask, _ = twin._views()
        assert torch.equal(step.final_obs["players"], final_obs)
        assert torch.equal(step.final_state, final_state)
        assert torch.equal(step.final_action_mask["players"], final_mask)
        # games still running keep their deck; finished ones were dealt a new one
        assert torch.equal(env.games.state["deck"][~done], decks[~done])
        assert not step.truncated.any()
        if done.any():
            ended += int(done.sum())
            # the new game starts from a fresh deal; the old one's last view is in final_obs
            assert (env.games.state["dealt"][done] == 10).all()
            assert (step.stats["length"][done] >= 1).all()
            # every move of a game is counted once, by its kind
            kinds = [step.stats[k][done] for k in ("discards", "plays", "hints")]
            torch.testing.assert_close(sum(kinds), step.stats["length"][done])
            assert (kinds[1] >= step.stats["lives_lost"][done]).all()  # misplays are plays
            lost = step.stats["lives_lost"][done] == 3
            assert (step.stats["score"][done][lost] == 0).all()
            # the reward of the last move brings the return to the final score
            got = before[done] + step.reward["players"][done, 0]
            torch.testing.assert_close(got, step.stats["score"][done])
            assert not torch.equal(step.final_obs["players"][done], step.obs["players"][done])
            # a finished game's final masks let nobody act but allow the idle move 0
            final_mask = step.final_action_mask["players"][done]
            assert final_mask[..., 0].all() and not final_mask[..., 1:].any()
            # the new games: player 0 to act
            assert step.alive["players"][done, 0].all()
        # what the step returns is what the games now show, every game, both reset paths
        obs, state, mask, alive = env._views()
        assert torch.equal(step.obs["players"], obs) and torch.equal(step.state, state)
        assert torch.equal(step.action_mask["players"], mask)
        assert torch.equal(step.alive["players"], alive)
        assert step.action_mask["players"].any(-1).all()
    assert ended > 16


def test_seeding_replays_and_decks_can_be_dealt():
    a, b = make("hanabi/full-2p", num_envs=4, seed=0), make("hanabi/full-2p", num_envs=4, seed=0)
    assert torch.equal(a.reset(seed=9).obs["players"], b.reset(seed=9).obs["players"])
    assert not torch.equal(a.reset(seed=10).obs["players"], b.reset(seed=9).obs["players"])
    decks = a.games.shuffled_decks(torch.Generator().manual_seed(3))
    step = a.deal(decks)
    assert torch.equal(a.games.state["hands"][:, 0], decks[:, :5])
    # the games keep a copy: changing the caller's tensor later changes nothing
    kept = decks.clone()
    decks[:, :] = 0
    assert torch.equal(a.games.state["deck"], kept)
    decks = kept
    # any integer array is accepted
    a.deal(decks.to(torch.int32))
    a.deal(decks.numpy().astype(np.int32))
    assert torch.equal(a.games.state["deck"], decks)
    assert step.state.shape == (4, a.spec.state_shape[0])
    bad = decks.clone()
    bad[0, 0] = bad[0, 1] = 0  # one card too many of red 1 and one too few of something
    bad[0, :3] = 0
    bad[0, 3] = 0
    with pytest.raises(EnvError, match="every deck must hold each card"):
        a.deal(bad)
    # card ids are whole numbers: a fractional deck is refused, not truncated
    with pytest.raises(EnvError, match="decks must hold whole card ids"):
        a.deal(decks.float() + 0.5)
    a.deal(decks.double())  # whole numbers in a float tensor are card ids all the same
    for junk in ("abc", None):
        with pytest.raises(EnvError, match="decks must"):
            a.deal(junk)


def test_state_round_trip_replays_the_same_game():
    env = make("hanabi/full-4p", num_envs=6, seed=1)
    step = env.reset()
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        step = env.step(_random_actions(step, gen))
    saved = env.get_state()
    env_rng = env.generator.get_state()

    def play(step) -> list[torch.Tensor]:
        moves = torch.Generator().manual_seed(7)
        out = []
        for _ in range(40):  # long enough for some games to end and restart
            step = env.step(_random_actions(step, moves))
            out.append(step.obs["players"])
        return out

    first = play(step)
    restored = env.set_state(saved)
    env.generator.set_state(env_rng)
    assert torch.equal(restored.obs["players"], step.obs["players"])
    for x, y in zip(first, play(restored), strict=True):
        assert torch.equal(x, y)
    with pytest.raises(EnvError, match="set_state needs every key"):
        env.set_state({"hands": saved["hands"]})
    # a subset of the games: they take the saved games' state, the others stay as they are
    now = env.get_state()
    ids = torch.tensor([3, 1])
    env.set_state({k: v[ids] for k, v in saved.items()}, ids)
    after = env.get_state()
    others = torch.tensor([0, 2, 4, 5])
    for k in saved:
        assert torch.equal(after[k][ids], saved[k][ids]), k
        assert torch.equal(after[k][others], now[k][others]), k
    # a state saved before the move counts existed (without "move_counts"): those games count
    # their moves from zero
    older = {k: v[ids] for k, v in saved.items() if k != "move_counts"}
    env.set_state(older, ids)
    assert (env.get_state()["move_counts"][ids] == 0).all()
    assert torch.equal(env.get_state()["hands"][ids], saved["hands"][ids])
    for bad, message in (
        (torch.tensor([True, False, True, False, False, False]), "integer indices"),
        (torch.tensor([0, 6]), "must lie in"),
        (torch.tensor([1, 1]), "must not repeat"),
    ):
        with pytest.raises(EnvError, match=message):
            env.set_state({k: v[:2] for k, v in saved.items()}, bad)
    # values a game cannot hold are refused before anything is written (on either backend
    # they would index past the game's tables)
    before = env.get_state()
    for key, value in (
        ("player", 7),
        ("hands", 1000),
        ("dealt", -100),
        ("deck", -1),
        ("info", 9),
        ("info", -5),
        ("life", 99),
        ("turns_left", 99),
        ("discards", 99),
        ("last_kind", 99),
        ("color_hint", 5),
        ("length", -3),
        ("move_counts", -1),
    ):
        wrong = {k: v.clone() for k, v in saved.items()}
        wrong[key].view(-1)[0] = value
        with pytest.raises(EnvError, match=f"state\\['{key}'\\] must hold values"):
            env.set_state(wrong)
    # a bad shape or type in the last key checked: nothing written before it either
    wrong = {k: v.clone() for k, v in saved.items()}
    wrong["move_counts"] = wrong["move_counts"][:, :2]
    with pytest.raises(EnvError, match="state\\['move_counts'\\] must be"):
        env.set_state(wrong)
    wrong = {k: v.clone() for k, v in saved.items()}
    wrong["life"] = wrong["life"].float() - 0.5
    with pytest.raises(EnvError, match="state\\['life'\\] must hold whole numbers"):
        env.set_state(wrong)
    for k, v in env.get_state().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", ["hanabi/full-2p", "hanabi/full-5p", "hanabi/very-small-2p"])
def test_every_state_a_game_reaches_is_accepted_by_set_state(name, backend):
    # the limits set_state checks are the game's own: random play through many games (ends
    # of deck, lost lives, restarts) never leaves them, on either backend
    env = make(name, num_envs=8, seed=3, backend=backend)
    step = env.reset()
    gen = torch.Generator().manual_seed(4)
    for _ in range(150):
        step = env.step(_random_actions(step, gen))
        state = env.get_state()
        env.set_state(state)
        for k, v in env.get_state().items():
            assert torch.equal(v, state[k]), k


def test_text_rendering_shows_hands_hints_and_tokens():
    env = make("hanabi/full-2p", num_envs=1, seed=0)
    decks = env.games.sorted_deck[None].clone()  # R1 R1 R1 R2 R2 | R3 R3 R4 R4 R5 | Y1 ...
    env.deal(decks)
    env.step({"players": torch.tensor([[[10], [0]]])})  # reveal color R to the other player
    text = env.render_text(0)
    assert "info 7" in text and "lives 3" in text and "fireworks: R0 Y0 G0 W0 B0" in text
    assert "player 1: R3||R?  R3||R?  R4||R?  R4||R?  R5||R?" in text
    assert "player 0: R1||??" in text


# -- the rule-based baseline --------------------------------------------------------------------


def test_the_scripted_player_moves_legally_and_never_misplays():
    from mappo.envs.hanabi.scripted import scripted_moves

    env = make("hanabi/full-3p", num_envs=64, seed=3)
    env.reset()
    env.validate_actions = False
    for _ in range(150):
        moves = scripted_moves(env)
        legal = env.games.legal_moves().gather(1, moves[:, None]).squeeze(1)
        assert legal.all()  # games restart when they end, so every game has a move to make
        step = env.step({"players": moves[:, None, None].expand(64, 3, 1)})
        # it only plays cards that the hints prove playable: no life is ever lost
        assert (step.stats["lives_lost"][step.done] == 0).all()
        lives = env.games.state["life"]
        assert (lives == 3).all()


def test_scripted_baseline_from_the_command_line(capsys):
    from mappo.cli import main

    assert main(["eval", "--scripted", "hanabi/full-2p", "--episodes", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "hanabi/full-2p" and out["algo"] == "scripted"
    # well above random play (which scores about 0) on 64 games
    assert out["eval_score"] > 10 and 0 <= out["eval_perfect"] <= 1 and out["eval_episodes"] == 64
    assert main(["eval", "--scripted", "hanabi/full-9p"]) == 2
    assert "unknown Hanabi variant 'hanabi/full-9p'" in capsys.readouterr().err


def test_scripted_player_renders_one_of_its_games(tmp_path, capsys):
    from PIL import Image

    from mappo.cli import main

    gif = tmp_path / "rules.gif"
    assert (
        main(["eval", "--scripted", "hanabi/very-small-2p", "--episodes", "4", "--gif", str(gif)])
        == 0
    )
    assert "frames to" in capsys.readouterr().out
    with Image.open(gif) as image:
        assert image.n_frames > 2  # a whole game: several moves, not only the deal


def test_hanabi_parameters_must_be_whole_numbers():
    for bad in ("two", 2.5, True):
        with pytest.raises(EnvError, match="players must be a whole number"):
            HanabiEnv(num_envs=1, players=bad)
    with pytest.raises(EnvError, match="^hanabi: Hanabi needs 2-5 players"):
        HanabiEnv(num_envs=1, players=6)
    # A registered name fixes what it names: three players are hanabi/full-3p, not a
    # hanabi/full-2p run that plays three.
    with pytest.raises(EnvError, match="'players' is set by the env's name \\(players=2\\)"):
        make("hanabi/full-2p", num_envs=1, players=3)
    with pytest.raises(EnvError, match="unknown parameter 'colours'; did you mean 'colors'"):
        make("hanabi/full-2p", num_envs=1, colours=3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_short_run_improves_its_score(tmp_path, precision):
    """Hanabi-Very-Small (one color): from the fresh policy's score to about 2 of 5 in 48k env
    steps (the players learn to hint and play the next card instead of guessing); also with
    the networks in bfloat16."""
    from mappo import config as C
    from mappo.trainer import Trainer, evaluate, train

    cfg = C.load(
        "hanabi/full-2p_fast",
        {
            "env.name": "hanabi/very-small-2p",
            "env.num_envs": 32,
            "rollout_length": 50,
            "total_env_steps": 48000,
            "eval_episodes": 64,
            "eval_interval": 0,
            "threads": 1,
            "progress": False,
            "tensorboard": False,
            "run_dir": str(tmp_path),
            "seed": 1,
            "model.precision": precision,
        },
    )
    fresh = Trainer(cfg)
    start = evaluate(fresh.policy, fresh.eval_env, seed=7)
    fresh.close()
    run = train(cfg)
    assert start["eval_score"] < 1.2
    assert run.summary["eval_score"] >= start["eval_score"] + 0.7


def test_games_render_to_frames_of_one_size(tmp_path):
    from mappo.cli import main

    env = make("hanabi/full-5p", num_envs=2, seed=0)
    step = env.reset()
    gen = torch.Generator().manual_seed(0)
    shapes = set()
    for _ in range(40):
        frame = env.render(1)
        assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3
        assert (frame < 255).any()  # something is drawn
        shapes.add(frame.shape)
        step = env.step(_random_actions(step, gen))
    assert len(shapes) == 1
    assert "last move: player" in env.render_text(1)
    gif = tmp_path / "game.gif"
    assert main(["render", "hanabi/full-2p", "--gif", str(gif), "--steps", "20"]) == 0
    assert gif.stat().st_size > 0


def test_a_resumed_run_lands_where_the_whole_run_lands(tmp_path):
    """Checkpoints hold the games in progress (get_state / set_state) and the deck generator,
    so a run resumed from its middle checkpoint ends with the whole run's parameters."""
    from mappo.trainer import resume, train

    common = {
        "env.name": "hanabi/small-2p",
        "env.num_envs": 8,
        "rollout_length": 20,
        "total_env_steps": 8 * 20 * 4,
        "checkpoint_interval": 2,
        "eval_interval": 0,
        "eval_episodes": 2,
        "threads": 1,
        "progress": False,
        "tensorboard": False,
    }
    whole = train("hanabi/full-2p_fast", {**common, "run_dir": str(tmp_path / "whole")})
    part = train("hanabi/full-2p_fast", {**common, "run_dir": str(tmp_path / "part")})
    for p in sorted((part.dir / "checkpoints").glob("iter_*.pt")):
        if p.name > "iter_00000002.pt":
            p.unlink()
    resumed = resume(part.dir)
    want = whole.policy.state_dict()
    for k, v in resumed.policy.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)


def test_the_gpu_preset_has_jaxmarls_batch_and_the_papers_critic(tmp_path):
    """hanabi/full-2p_gpu: the paper's MAPPO loss and critic without the GRU, with JaxMARL's
    IPPO-Hanabi batch and optimiser settings; it trains and evaluates (here on the CPU, made
    small)."""
    from mappo import config as C
    from mappo.trainer import train

    cfg = C.load("hanabi/full-2p_gpu")
    assert (cfg.env.num_envs, cfg.rollout_length) == (1024, 128)
    assert (cfg.algo.epochs, cfg.algo.num_minibatches) == (4, 4)
    assert (cfg.algo.actor_lr, cfg.algo.critic_lr, cfg.algo.entropy_coef) == (5e-4, 5e-4, 0.01)
    assert cfg.algo.max_grad_norm == 0.5 and cfg.model.hidden_sizes == [512, 512]
    assert cfg.model.recurrent == "none" and cfg.model.activation == "relu"
    assert cfg.algo.critic_input == "state" and cfg.algo.policy_active_masks
    assert cfg.algo.value_loss == "huber" and cfg.algo_name == "mappo"
    small = {
        "env.num_envs": 8,
        "rollout_length": 16,
        "total_env_steps": 8 * 16 * 2,
        "model.hidden_sizes": [32, 32],
        "eval_episodes": 4,
        "threads": 1,
        "progress": False,
        "run_dir": str(tmp_path),
    }
    run = train("hanabi/full-2p_gpu", small)
    assert run.summary["env_steps"] == 256 and 0 <= run.summary["eval_score"] <= 25


def test_impossible_rules_are_refused_in_one_line():
    with pytest.raises(EnvError, match="2-5 players"):
        HanabiEnv(num_envs=1, players=6)
    for kwargs, message in (
        ({"colors": 1, "ranks": 1}, "cards per hand"),
        ({"hand_size": 0}, "cards per hand"),
        ({"max_life_tokens": 0}, "at least one life token"),
    ):
        with pytest.raises(EnvError, match=message):
            make("hanabi/full-2p", num_envs=1, **kwargs)


def _paper_knowledge_bits(rules: HanabiRules, s: dict, observer: int) -> list[int]:
    """The paper code's knowledge section for one observer of one game (``s``: that game's
    state as lists), computed card by card as its C++ does: plausible (0/1) times the copies
    left, divided by the slot's sum in an integer (so truncated)."""
    p, h, c, rk = rules.players, rules.hand, rules.colors, rules.ranks
    left = []
    for card in range(c * rk):
        color, rank = divmod(card, rk)
        played = s["fireworks"][color] > rank
        left.append(rules.instances(rank) - s["discards"][card] - int(played))
    bits = []
    for k in range(p):
        holder = (observer + k) % p
        for slot in range(h):
            enc = [0] * (c * rk)
            if slot < s["hand_count"][holder]:
                for card in range(c * rk):
                    color, rank = divmod(card, rk)
                    ok = s["color_ok"][holder][slot][color] and s["rank_ok"][holder][slot][rank]
                    enc[card] = int(ok) * left[card]
                total = float(sum(enc))
                enc = [int(v / total) for v in enc]
            bits += enc
            bits += [int(s["color_hint"][holder][slot] == i) for i in range(c)]
            bits += [int(s["rank_hint"][holder][slot] == i) for i in range(rk)]
    return bits


def _discards_first(step, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Discard slot 0 where allowed, else a random legal hint: never plays, so the games run
    out the deck and end with short hands (empty slots)."""
    mask = step.action_mask["players"].clone()
    discard = mask[..., 0].clone()
    mask[..., 0:10] = False  # no discards or plays among the hints (5-card hands)
    e, p, m = mask.shape
    mask[..., 0] |= ~mask.any(-1)  # waiting seats: move 0
    hints = torch.multinomial(mask.reshape(-1, m).float(), 1, generator=gen).reshape(e, p)
    return {"players": torch.where(discard, 0, hints)[..., None]}


@pytest.mark.parametrize(
    ("variant", "policy", "steps", "every"),
    [("hanabi/full-3p", _random_actions, 12, 1), ("hanabi/full-3p", _discards_first, 100, 1)],
)
def test_the_paper_observation_is_the_paper_codes(variant, policy, steps, every):
    """``observation="paper"``: the canonical observation with the knowledge section's
    plausible cards replaced as the paper code's integer "V0 belief" computes them (the card's
    one-hot where it is determined, else zeros) and a one-hot of the player to act appended; the
    global state is the own hand and then that observation. Random play (hints determine some
    cards) and play that runs out the deck (short hands)."""
    n = 24 if policy is _random_actions else 4
    paper = make(variant, num_envs=n, seed=5, observation="paper")
    plain = make(variant, num_envs=n, seed=5)
    sp, sc = paper.reset(), plain.reset()
    r = plain.rules
    players, cards = r.players, r.colors * r.ranks
    per_slot = cards + r.colors + r.ranks
    start = r.observation_size - players * r.hand * per_slot  # the knowledge section
    size, hand = r.observation_size + players, r.hand * cards
    rows = torch.arange(n)
    gen = torch.Generator().manual_seed(3)
    determined = short = 0
    for t in range(steps):
        me = paper.games.state["player"]
        obs_p, obs_c = sp.obs["players"], sc.obs["players"]
        assert obs_p.shape == (n, players, size)
        torch.testing.assert_close(obs_p[..., :start], obs_c[..., :start], rtol=0, atol=0)
        turn = torch.nn.functional.one_hot(me, players).to(obs_p.dtype)
        torch.testing.assert_close(obs_p[..., -players:], turn[:, None].expand(-1, players, -1))
        torch.testing.assert_close(sp.state[:, hand:], obs_p[rows, me])
        torch.testing.assert_close(sp.state[:, :hand], sc.state[:, r.observation_size :])
        if t % every == 0:
            state = {k: v.tolist() for k, v in paper.games.state.items()}
            for g in range(n):
                game = {k: v[g] for k, v in state.items()}
                short += min(game["hand_count"]) < r.hand
                for o in range(players):
                    want = _paper_knowledge_bits(r, game, o)
                    assert obs_p[g, o, start : r.observation_size].long().tolist() == want
                    determined += sum(
                        sum(want[i : i + cards]) for i in range(0, len(want), per_slot)
                    )
        acts = policy(sp, gen)
        sp, sc = paper.step(acts), plain.step(acts)
    if policy is _random_actions:
        assert determined > 0  # the section is not all zeros
    else:
        assert short > 0  # hands with empty slots were checked
    with pytest.raises(EnvError, match="observation must be"):
        make("hanabi/full-2p", num_envs=1, observation="belief")


@pytest.mark.parametrize(
    ("preset", "extra"),
    [
        ("hanabi/full-2p_fast", {}),  # feed-forward: the losses take the acting rows only
        ("hanabi/full-2p", {"model.hidden_sizes": [32], "algo.epochs": 2}),  # GRU on chunks
    ],
)
def test_rollouts_keep_observations_as_bytes_and_learn_the_same(monkeypatch, preset, extra):
    """Hanabi declares byte observations: MAPPO's rollout stores its observations and critic
    inputs as bytes (a quarter of float32), the networks read them as floats, and training
    is bit for bit what float storage gives, and what the env's float32 observations give."""
    from mappo import config as C
    from mappo.envs.hanabi.env import HanabiEnv
    from mappo.trainer import Trainer

    overrides = {
        "env.name": "hanabi/small-2p",
        "env.num_envs": 8,
        "rollout_length": 20,
        "threads": 1,
        "progress": False,
        "tensorboard": False,
        **extra,
    }

    def run(**more) -> tuple[dict[str, torch.dtype], dict[str, torch.Tensor]]:
        trainer = Trainer(C.load(preset, {**overrides, **more}))
        assert trainer.env.dtype == (torch.float32 if more else torch.uint8)
        for _ in range(2):
            trainer.iterate()
        buf = trainer.learner.collector.rollout.groups["players"]
        dtypes = {"obs": buf.obs.dtype, "critic_x": buf.critic_x.dtype}
        params = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
        trainer.close()
        return dtypes, params

    as_bytes, params = run()
    from_floats, from_float_params = run(**{"env.kwargs.dtype": "float32"})
    monkeypatch.setattr(HanabiEnv, "byte_observations", False)
    as_floats, float_params = run()
    assert as_bytes == from_floats == {"obs": torch.uint8, "critic_x": torch.uint8}
    assert as_floats == {"obs": torch.float32, "critic_x": torch.float32}
    for k, v in params.items():
        torch.testing.assert_close(v, float_params[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(v, from_float_params[k], rtol=0, atol=0, msg=k)


def test_an_env_that_breaks_its_byte_declaration_is_refused(monkeypatch):
    """An env that declares byte observations but returns other values is stopped at the first
    step of a rollout with a one-line error (a byte rollout would truncate them)."""
    from mappo import config as C
    from mappo.trainer import Trainer

    with make("mpe/simple_spread", num_envs=1) as env:
        kind = type(env)
    monkeypatch.setattr(kind, "byte_observations", True)
    cfg = C.load(
        "mpe/simple_spread_fast",
        {"env.num_envs": 4, "rollout_length": 5, "threads": 1, "progress": False},
    )
    trainer = Trainer(cfg)
    with pytest.raises(EnvError, match="declares byte_observations") as err:
        trainer.iterate()
    trainer.close()
    assert "\n" not in str(err.value)


def _compiler_refusing(pattern: str, monkeypatch, tmp_path) -> None:
    """Make ``$CC`` a compiler that fails on any argument matching the shell ``pattern`` (the
    system's ``cc`` otherwise), with a fresh cache and no library loaded yet."""
    import shutil

    from mappo.envs.hanabi import native

    cc = shutil.which("cc")
    wrapper = tmp_path / "cc-refusing"
    wrapper.write_text(
        f'#!/bin/sh\nfor a in "$@"; do case "$a" in {pattern}) '
        f'echo "unknown argument $a" >&2; exit 1;; esac; done\nexec {cc} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("MAPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(native, "_libraries", {})
    monkeypatch.setattr(native, "_reason", None)


def test_a_compiler_without_the_libcall_option_still_builds(monkeypatch, tmp_path):
    """On x86-64 the library is first built with its copies as calls to the C library
    (``-mstringop-strategy=libcall``); a compiler that does not know the option (clang) gets
    the build without it, and the games are the same."""
    _native_or_skip()
    from mappo.envs.hanabi import native

    _compiler_refusing("-mstringop-strategy=*", monkeypatch, tmp_path)
    rules = HanabiRules(players=3)
    fast = HanabiGames(rules, 64, backend="native")
    assert fast.native is not None and native.unavailable_reason() is None
    plain = HanabiGames(rules, 64, backend="torch")
    decks = plain.shuffled_decks(torch.Generator().manual_seed(4))
    plain.reset(decks)
    fast.reset(decks)
    moves = plain.legal_moves().float().argmax(1)
    assert torch.equal(fast.step(moves), plain.step(moves))
    for k, v in plain.state.items():
        assert torch.equal(fast.state[k], v), k


def test_a_compiler_without_openmp_gets_the_build_with_our_own_threads(monkeypatch, tmp_path):
    """Where ``-fopenmp`` does not compile (a compiler without OpenMP), the library is built
    without it and splits games between threads of its own, giving the same games; nothing is
    reported as unavailable."""
    _native_or_skip()
    from mappo.envs.hanabi import native

    _compiler_refusing("-fopenmp", monkeypatch, tmp_path)
    monkeypatch.setattr(native, "_torch_uses_libgomp", lambda: True)
    rules = HanabiRules(players=3)
    fast = HanabiGames(rules, 600, backend="native")
    assert fast.native is not None and not fast.native._openmp
    assert native.unavailable_reason() is None
    plain = HanabiGames(rules, 600, backend="torch")
    decks = plain.shuffled_decks(torch.Generator().manual_seed(4))
    plain.reset(decks)
    fast.reset(decks)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(20):
            legal = plain.legal_moves()
            assert torch.equal(fast.legal_moves(), legal)
            moves = legal.int().argmax(1)
            assert torch.equal(fast.step(moves), plain.step(moves))
        assert torch.equal(fast.observe_all(), plain.observe_all())
    finally:
        torch.set_num_threads(previous)


def test_a_recorded_game_ends_on_its_last_state():
    """A GIF of a game shows how it ended (the lost last life, the final score): the step that
    ends a game resets it, so the game keeps its ended state for the recording's last frame."""
    from mappo.envs import make
    from mappo.envs.base import EnvError
    from mappo.envs.rendering import record_episode, record_steps

    env = make("hanabi/full-2p", num_envs=1, seed=3)
    with pytest.raises(EnvError, match="no ended game kept"):
        env.render_text(0, ended=True)
    frames = record_episode(env, seed=3)
    assert env.keep_ended is False  # (training does not pay for the copies)
    text = env.render_text(0, ended=True)
    assert "lives 0" in text and text.startswith("score 0")  # random play loses its lives
    assert "game over: no lives left" in text.splitlines()[0]
    assert "misplayed, a life lost" in text.splitlines()[-1]
    np.testing.assert_array_equal(frames[-1], env.render_ended(0))
    assert not np.array_equal(frames[-1], frames[-2])
    again, taken, ended = record_steps(env, seed=3)  # (what `mappo render` reports)
    assert ended and len(again) == len(frames) == taken + 1


def test_a_new_env_refuses_to_step_or_draw_before_a_game_and_takes_a_saved_one():
    """Before reset() or deal() there is no game: stepping, reading the state and drawing say
    so in one line; a saved game loads into a new env (for analysing a position)."""
    fresh = make("hanabi/full-2p", num_envs=2, seed=0)
    moves = {"players": torch.zeros(2, 2, 1, dtype=torch.long)}
    for call in (lambda: fresh.step(moves), fresh.get_state, lambda: fresh.render_text(0)):
        with pytest.raises(EnvError, match=r"call reset\(\) or deal\(\) first"):
            call()
    played = make("hanabi/full-2p", num_envs=2, seed=4)
    mask = played.reset().action_mask["players"]  # [2, 2, A]: player 0 acts first
    first = mask[:, 0].int().argmax(-1)  # each game's first legal move
    played.step({"players": torch.stack([first, torch.zeros_like(first)], 1).unsqueeze(-1)})
    saved = played.get_state()
    step = fresh.set_state(saved)
    for key, value in fresh.get_state().items():
        assert torch.equal(value, saved[key]), key
    assert fresh.render_text(1) == played.render_text(1)
    assert step.action_mask["players"].any()
    for bad in (2, -1, True):
        with pytest.raises(EnvError, match="env_index must be 0 to 1"):
            fresh.render_text(bad)
