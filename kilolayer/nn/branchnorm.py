"""BranchNorm (Liu, Zeng, Meng, Zhou; arXiv 2305.02790): Post-LN whose branch output is
rescaled by the training step, normalised at the start and left as it is from step T on (docs/deepnet.md)::

    x <- LN(x + F(x) * (Var(F(x)) + eps)^(-(1 - lambda_t) / 2)),    lambda_t = min(t / T, 1)

Var is over the channels of each token and t the number of updates applied. At t = 0 every branch adds a
unit-variance output, whatever its weights, so an update cannot grow it; from t = T the sublayer is plain
Post-LN. (Centring the branch as well would change nothing: the LayerNorm after the add removes any per-token
constant.) The step lives in the model, one buffer per sublayer, set through :meth:`Scheme.on_step
<kilolayer.nn.residual.Scheme.on_step>`, so checkpoints carry it and a resumed run continues the schedule.
"""

from __future__ import annotations

import torch
from torch import nn

from kilolayer.config import ModelConfig
from kilolayer.nn.residual import SCHEMES
from kilolayer.nn.schemes import PostLN

DEFAULT_STEPS = ModelConfig.model_fields["branchnorm_steps"].default


def progress(step: int, steps: int) -> float:
    """lambda_t = min(t / T, 1)."""
    return min(step / steps, 1.0)


class BranchNormScale(nn.Module):
    """``y -> y * (Var(y) + eps)^(-(1 - lambda_t) / 2)`` with ``t`` the buffer ``step``, ``T`` = ``steps``."""

    def __init__(self, steps: int, eps: float):
        super().__init__()
        self.steps, self.eps = steps, eps
        # an integer keeps every step exact and is left alone by model.to(dtype)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        lam = (self.step / self.steps).clamp(max=1.0)
        var = y.float().var(dim=-1, unbiased=False, keepdim=True)
        return y * ((var + self.eps) ** ((lam - 1) / 2)).to(y.dtype)

    def extra_repr(self) -> str:
        return f"steps={self.steps}, eps={self.eps:g}"


@SCHEMES.register()
class BranchNorm(PostLN):
    """BranchNorm: Post-LN with the branch output normalised early in training, the normalisation fading out
    linearly over the first T updates (``model.branchnorm_steps``)."""

    name = "branchnorm"

    @property
    def steps(self) -> int:
        """T: the updates over which the normalisation fades out."""
        return int(self.options.get("branchnorm_steps") or DEFAULT_STEPS)

    def branch_scale_module(self, site, width, eps):
        return BranchNormScale(self.steps, eps)

    def outside_residual(self, site):
        return [*super().outside_residual(site), "the training step, which the trainer tells kilolayer's stacks"]

    def on_step(self, stack, step):
        for layer in stack.layers:
            for res in layer.sublayers():
                res.branch_scale.step.fill_(step)

    def describe(self):
        return {"all": {"T": self.steps}}
