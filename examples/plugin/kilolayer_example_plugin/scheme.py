"""``gpt2_pre_ln``: Pre-LN, x <- x + F(LN(x)), with GPT-2's initialisation of the weights that write into the
residual stream: the attention output ``o`` and the FFN's ``w2`` start at Xavier gain 1/sqrt(N), N the residual
sublayers of their side (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", section 2.3),
so the N branch outputs summed into the stream start with about the variance of one."""

from __future__ import annotations

from kilolayer.nn.residual import Site
from kilolayer.nn.schemes import PreLN


class GPT2PreLN(PreLN):
    name = "gpt2_pre_ln"

    def init_gain(self, site: Site, weight: str) -> float:
        if weight not in ("o", "w2"):
            return 1.0
        return self.depth.sublayers(site.side) ** -0.5

    def describe(self) -> dict:
        return {side: {"gain": self.init_gain(Site(side, 0, "ffn"), "w2")} for side in self.depth.sides()}
