"""The model: attention, feed-forward, residual schemes, layers, stacks, budgets."""
