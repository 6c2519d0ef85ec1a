"""The model: attention, feed-forward, residual schemes, layers, stacks, budgets."""

# each scheme module registers its schemes in kilolayer.nn.residual.SCHEMES
from kilolayer.nn import admin, branchnorm, deepnorm, schemes  # noqa: F401
