"""Neural-network building blocks: masked multi-head distributions and value normalisers."""

from mappo.nn.distributions import MultiCategorical
from mappo.nn.normalizers import PopArt, ValueNorm

__all__ = ["MultiCategorical", "PopArt", "ValueNorm"]
