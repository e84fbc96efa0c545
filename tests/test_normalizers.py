"""ValueNorm and PopArt against a float64 NumPy model of the MAPPO reference update rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mappo.nn import PopArt, ValueNorm


class NumpyValueNorm:
    """The update rule written out in float64: EMA of mean and mean square, debiased."""

    def __init__(self, shape: tuple[int, ...], beta: float, epsilon: float = 1e-5) -> None:
        self.m = np.zeros(shape)
        self.s = np.zeros(shape)
        self.d = 0.0
        self.beta, self.epsilon = beta, epsilon

    def update(self, x: np.ndarray) -> None:
        axes = tuple(range(x.ndim - self.m.ndim))
        self.m = self.beta * self.m + (1 - self.beta) * x.mean(axes)
        self.s = self.beta * self.s + (1 - self.beta) * (x**2).mean(axes)
        self.d = self.beta * self.d + (1 - self.beta)

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        d = max(self.d, self.epsilon)
        mean = self.m / d
        return mean, np.sqrt(np.maximum(self.s / d - mean**2, 1e-2))


@pytest.mark.parametrize("beta", [0.99999, 0.9, 0.0])
@pytest.mark.parametrize("shape", [1, (), (3, 1)])
def test_mean_std_match_numpy(beta: float, shape: int | tuple[int, ...]) -> None:
    norm = ValueNorm(shape, beta=beta)
    full = (shape,) if isinstance(shape, int) else shape
    ref = NumpyValueNorm(full, beta)
    rng = np.random.default_rng(0)
    for i, batch in enumerate([(25, 8), (25, 8), (7,), (400, 2, 4)]):
        x = rng.normal(loc=-30.0 + 5 * i, scale=4.0 + i, size=(*batch, *full))
        norm.update(torch.as_tensor(x, dtype=torch.float32))
        ref.update(x)
        mean, std = norm.mean_std()
        ref_mean, ref_std = ref.mean_std()
        assert mean.shape == std.shape == full
        np.testing.assert_allclose(mean.numpy(), ref_mean, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(std.numpy(), ref_std, rtol=1e-3, atol=1e-4)


def test_debiasing_makes_first_update_exact_batch_statistics() -> None:
    # After one update the EMA holds (1 - beta) * stats and the debiasing term (1 - beta), so
    # the debiased statistics are the batch's own, even with beta = 0.99999.
    norm = ValueNorm(1)
    x = torch.tensor([[1.0], [2.0], [3.0], [6.0]])
    norm.update(x)
    mean, std = norm.mean_std()
    torch.testing.assert_close(mean, torch.tensor([3.0]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(std, torch.tensor([3.5]).sqrt(), rtol=1e-3, atol=1e-3)
    # Each update is one EMA step whatever its size: with beta ~ 1 the mean becomes the plain
    # average of the two batch means, not the average over samples (which would be 6.33).
    norm.update(torch.tensor([[13.0], [13.0]]))
    mean, _ = norm.mean_std()
    torch.testing.assert_close(mean, torch.tensor([8.0]), rtol=1e-3, atol=1e-3)


def test_before_any_update_and_variance_floor() -> None:
    norm = ValueNorm(1)
    mean, std = norm.mean_std()
    assert mean.item() == 0.0 and std.item() == pytest.approx(0.1)
    norm.update(torch.full((10, 1), 7.0))  # constant targets: variance 0, floored at 1e-2
    mean, std = norm.mean_std()
    assert mean.item() == pytest.approx(7.0, rel=1e-5)
    assert std.item() == pytest.approx(0.1, rel=1e-5)


def test_normalize_denormalize_round_trip() -> None:
    norm = ValueNorm((3, 1))
    norm.update(torch.randn(64, 3, 1) * torch.tensor([[1.0], [10.0], [100.0]]) + 50.0)
    x = torch.randn(25, 8, 3, 1) * 100.0
    y = norm.normalize(x)
    mean, std = norm.mean_std()
    torch.testing.assert_close(y, (x - mean) / std)
    torch.testing.assert_close(norm.denormalize(y), x, rtol=1e-5, atol=1e-3)
    assert not y.requires_grad


def test_normalize_is_differentiable_in_its_input() -> None:
    norm = ValueNorm(1)
    norm.update(torch.randn(100, 1) * 5.0)
    x = torch.randn(4, 1, requires_grad=True)
    norm.denormalize(x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, norm.mean_std()[1].expand(4, 1))


def test_buffers_are_checkpointed_and_not_trained() -> None:
    norm = ValueNorm(1)
    norm.update(torch.randn(32, 1) * 3.0 + 2.0)
    state = norm.state_dict()
    assert set(state) == {"running_mean", "running_mean_sq", "debiasing_term"}
    assert list(norm.parameters()) == []
    restored = ValueNorm(1)
    restored.load_state_dict(state)
    for a, b in zip(norm.mean_std(), restored.mean_std(), strict=True):
        assert torch.equal(a, b)
    norm.reset()
    assert norm.mean_std()[0].item() == 0.0


def test_update_ignores_the_autograd_graph() -> None:
    norm = ValueNorm(1)
    x = torch.randn(8, 1, requires_grad=True)
    norm.update(x * 2.0)
    assert not norm.running_mean.requires_grad


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="trailing dims"):
        ValueNorm((3, 1)).update(torch.zeros(10, 2, 1))
    with pytest.raises(ValueError, match="beta"):
        ValueNorm(1, beta=1.0)


def _linear_head(copies: int, d_in: int, seed: int) -> tuple[nn.Parameter, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    weight = nn.Parameter(torch.randn(copies, d_in, 1, generator=g))
    bias = nn.Parameter(torch.randn(copies, 1, generator=g))
    return weight, bias


def _head(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``[B, C, in] -> [B, C, 1]`` normalised values, as a per-agent linear layer computes."""
    return torch.einsum("bci,cio->bco", x, weight) + bias


@pytest.mark.parametrize(
    ("copies", "shape"),
    [(1, 1), (4, 1), (4, (4, 1))],
    ids=["shared", "per-agent", "per-agent-stats"],
)
def test_popart_preserves_denormalised_outputs(copies: int, shape: int | tuple[int, ...]) -> None:
    d_in, agents = 6, 4
    weight, bias = _linear_head(copies, d_in, seed=0)
    popart = PopArt(shape, beta=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, agents, d_in, generator=g)
    for step in range(4):
        before = popart.denormalize(_head(x, weight, bias))
        old_weight = weight.detach().clone()
        targets = 100.0 * torch.randn(50, agents, 1, generator=g) + 20.0 * step - 40.0
        popart.update(targets, weight, bias)
        after = popart.denormalize(_head(x, weight, bias))
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-3)
        assert not torch.allclose(weight, old_weight)  # the head really was rescaled
    assert isinstance(weight, nn.Parameter) and weight.grad is None


def test_popart_update_matches_valuenorm_statistics_and_formula() -> None:
    weight, bias = _linear_head(1, 3, seed=2)
    popart, plain = PopArt(1), ValueNorm(1)
    targets = torch.randn(40, 1) * 7.0 + 3.0
    old_mean, old_std = popart.mean_std()
    w0, b0 = weight.detach().clone(), bias.detach().clone()
    popart.update(targets, weight, bias)
    plain.update(targets)
    new_mean, new_std = popart.mean_std()
    for a, b in zip((new_mean, new_std), plain.mean_std(), strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(weight.detach(), w0 * old_std / new_std)
    torch.testing.assert_close(bias.detach(), (old_std * b0 + old_mean - new_mean) / new_std)


def test_popart_with_nn_linear_through_transposed_view() -> None:
    layer = nn.Linear(5, 1)
    popart = PopArt(1, beta=0.5)
    popart.update(torch.randn(16, 1) * 3.0)
    x = torch.randn(10, 5)
    before = popart.denormalize(layer(x))
    popart.update(torch.randn(16, 1) * 30.0 + 9.0, layer.weight.mT, layer.bias)
    torch.testing.assert_close(popart.denormalize(layer(x)), before, rtol=1e-4, atol=1e-3)


def test_popart_rejects_mismatched_head() -> None:
    popart = PopArt((4, 1))
    weight, bias = _linear_head(3, 5, seed=3)
    with pytest.raises(ValueError, match="weight of shape"):
        popart.update(torch.zeros(8, 4, 1), weight, None)
    with pytest.raises(ValueError, match="bias of shape"):
        popart.update(torch.zeros(8, 4, 1), None, bias)


def test_running_moments_are_float64_where_the_device_has_it():
    # Apple's MPS has no float64: the value family's reward standardiser was built there in
    # float64 and failed as it moved to the device.
    from mappo.nn.normalizers import RunningMeanStd, moment_dtype

    assert moment_dtype(torch.device("cpu")) == torch.float64
    assert moment_dtype(torch.device("cuda")) == torch.float64
    assert moment_dtype(torch.device("mps")) == torch.float32
    norm = RunningMeanStd(device="cpu")
    norm.update(torch.tensor([1.0, 3.0]))
    assert norm.mean.dtype == torch.float64 and float(norm.mean) == pytest.approx(2.0, rel=1e-4)
