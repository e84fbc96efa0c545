"""GAE and lambda-returns against hand-computed sequences and a float64 reference loop."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mappo.algos.returns import AdvantageReturns, gae, next_values, td_lambda

# A three-step rollout used by the hand-computed cases:
# deltas without any episode end (gamma = 0.9): 1 + 0.9 * 1.0 - 0.5 = 1.4,
# 2 + 0.9 * 1.5 - 1.0 = 2.35, 3 + 0.9 * 2.0 - 1.5 = 3.3.
R = torch.tensor([1.0, 2.0, 3.0])
V = torch.tensor([0.5, 1.0, 1.5])
NV = torch.tensor([1.0, 1.5, 2.0])
NO = torch.zeros(3, dtype=torch.bool)
AT1 = torch.tensor([False, True, False])


def _both(*args: Any, **kwargs: Any) -> AdvantageReturns:
    """Run gae and td_lambda; assert they agree; return gae's result."""
    a = gae(*args, **kwargs)
    b = td_lambda(*args, **kwargs)
    torch.testing.assert_close(b.returns, a.returns)
    torch.testing.assert_close(b.advantages, a.advantages)
    return a


def test_no_episode_end() -> None:
    adv, ret = _both(R, V, NV, NO, NO, gamma=0.9, lam=0.8)
    # A2 = 3.3; A1 = 2.35 + 0.72 * 3.3 = 4.726; A0 = 1.4 + 0.72 * 4.726 = 4.80272.
    torch.testing.assert_close(adv, torch.tensor([4.80272, 4.726, 3.3]))
    torch.testing.assert_close(ret, adv + V)


def test_termination_mid_rollout() -> None:
    nv = NV.clone()
    nv[1] = 99.0  # the value after a terminal step is ignored
    adv, _ = _both(R, V, nv, AT1, NO, gamma=0.9, lam=0.8)
    # delta1 = 2 - 1.0 = 1.0 and A1 does not look past the end: A1 = 1.0; A0 = 1.4 + 0.72 * 1.0.
    torch.testing.assert_close(adv, torch.tensor([2.12, 1.0, 3.3]))


def test_truncation_with_bootstrap() -> None:
    nv = NV.clone()
    nv[1] = 5.0  # V(final observation) of the truncated episode
    adv, _ = _both(R, V, nv, NO, AT1, gamma=0.9, lam=0.8)
    # delta1 = 2 + 0.9 * 5 - 1 = 5.5 = A1 (no crossing); A0 = 1.4 + 0.72 * 5.5 = 5.36.
    torch.testing.assert_close(adv, torch.tensor([5.36, 5.5, 3.3]))


def test_truncation_without_bootstrap_equals_termination() -> None:
    nv = NV.clone()
    nv[1] = 0.0  # the caller does not bootstrap time limits (the paper code's default)
    adv_trunc, _ = _both(R, V, nv, NO, AT1, gamma=0.9, lam=0.8)
    adv_term, _ = _both(R, V, NV, AT1, NO, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv_trunc, torch.tensor([2.12, 1.0, 3.3]))
    torch.testing.assert_close(adv_trunc, adv_term)


def test_lam_zero_is_one_step_td_error() -> None:
    adv, ret = _both(R, V, NV, AT1, NO, gamma=0.9, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.4, 1.0, 3.3]))
    torch.testing.assert_close(ret, torch.tensor([1.9, 2.0, 4.8]))


def test_lam_one_is_discounted_monte_carlo_return() -> None:
    _, ret = _both(R, V, NV, NO, NO, gamma=0.9, lam=1.0)
    # G2 = 3 + 0.9 * 2.0 = 4.8 (bootstrapped at the rollout end); G1 = 2 + 0.9 * 4.8; G0 = ...
    torch.testing.assert_close(ret, torch.tensor([6.688, 6.32, 4.8]))
    _, ret = _both(R, V, NV, AT1, NO, gamma=0.9, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([2.8, 2.0, 4.8]))


def _numpy_gae(
    r: np.ndarray,
    v: np.ndarray,
    nv: np.ndarray,
    term: np.ndarray,
    trunc: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """Textbook GAE in float64 with an explicit branch per case."""
    adv = np.zeros_like(r)
    following = np.zeros_like(r[0])
    for t in reversed(range(len(r))):
        ended = term[t] | trunc[t]
        delta = r[t] + gamma * np.where(term[t], 0.0, nv[t]) - v[t]
        following = delta + gamma * lam * np.where(ended, 0.0, following)
        adv[t] = following
    return adv


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
def test_random_batch_matches_reference_and_td_lambda(lam: float) -> None:
    g = torch.Generator().manual_seed(0)
    t, e, n = 40, 16, 3
    r = torch.randn(t, e, n, generator=g, dtype=torch.float64)
    v_ext = torch.randn(t + 1, e, n, generator=g, dtype=torch.float64)
    final = torch.randn(t, e, n, generator=g, dtype=torch.float64)
    term = torch.rand(t, e, 1, generator=g) < 0.1  # per-env flags broadcast over agents
    trunc = (torch.rand(t, e, 1, generator=g) < 0.1) & ~term
    # A consistent rollout: next_values[t] = values[t + 1] wherever the episode goes on (the
    # identity "GAE returns = lambda-returns" needs it); junk after terminal steps is ignored.
    v = v_ext[:-1]
    nv = torch.where(term, -1e3, next_values(v_ext, trunc, final))
    adv, ret = _both(r, v, nv, term, trunc, gamma=0.99, lam=lam)
    full = (t, e, n)
    ref = _numpy_gae(
        r.numpy(), v.numpy(), nv.numpy(), term.expand(full).numpy(), trunc.expand(full).numpy(),
        0.99, lam,
    )  # fmt: skip
    np.testing.assert_allclose(adv.numpy(), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, adv + v)
    # Float 0/1 flags give the same answer as bool flags.
    adv_f, _ = gae(r, v, nv, term.double(), trunc.double(), 0.99, lam)
    torch.testing.assert_close(adv_f, adv)


def test_batch_dims_are_independent() -> None:
    g = torch.Generator().manual_seed(1)
    r, v, nv = (torch.randn(10, 5, generator=g) for _ in range(3))
    term = torch.rand(10, 5, generator=g) < 0.2
    trunc = torch.zeros(10, 5, dtype=torch.bool)
    adv, _ = gae(r, v, nv, term, trunc, 0.9, 0.9)
    for j in range(5):
        col, _ = gae(r[:, j], v[:, j], nv[:, j], term[:, j], trunc[:, j], 0.9, 0.9)
        torch.testing.assert_close(adv[:, j], col)


def test_single_step_rollout() -> None:
    adv, ret = _both(R[:1], V[:1], NV[:1], NO[:1], NO[:1], 0.9, 0.95)
    torch.testing.assert_close(ret, torch.tensor([1.9]))
    torch.testing.assert_close(adv, torch.tensor([1.4]))


def test_next_values() -> None:
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0]])  # [T + 1, B]
    truncated = torch.tensor([[False], [True], [False]])
    final = torch.tensor([[10.0], [20.0], [30.0]])
    torch.testing.assert_close(
        next_values(values, truncated, final), torch.tensor([[2.0], [20.0], [4.0]])
    )
    torch.testing.assert_close(next_values(values, truncated), torch.tensor([[2.0], [0.0], [4.0]]))


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="values has shape"):
        gae(R, V[:2], NV, NO, NO, 0.9, 0.9)
    with pytest.raises(ValueError, match="terminated has shape"):
        gae(R, V, NV, NO[:2], NO, 0.9, 0.9)
    with pytest.raises(ValueError, match="gamma and lam"):
        td_lambda(R, V, NV, NO, NO, 1.5, 0.9)
