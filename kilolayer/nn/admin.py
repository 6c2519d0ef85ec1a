"""Admin (Liu et al. 2020): x <- LN(omega * x + F(x)) with a learned per-channel shortcut scale omega.

omega starts at the profile-free default ``sqrt((n + 1) / ln(n + 1) - 1)`` for the n sublayers of a side, or,
with ``model.admin_omega: profile``, at values measured on one batch (docs/deepnet.md): one chain per side,
starting at 1, where sublayer i gets ``omega_i = ratio`` and then ``ratio = sqrt(Var(omega_i x) + Var(F_i(x)))``.

Profiling needs data, so it is not part of building: :func:`kilolayer.nn.transformer.data_dependent_init` runs
it (the trainer calls that for every scheme). Until it has run, or weights have been loaded, a model built with
``admin_omega: profile`` refuses to train, so a forgotten profile is an error rather than a silent default.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from kilolayer.errors import ConfigError
from kilolayer.nn.residual import SCHEMES, LearnedShortcut, Residual, Site
from kilolayer.nn.schemes import PostLN

UNPROFILED = (
    "model.admin_omega=profile: Admin's omega has not been profiled; after build_model, call "
    "kilolayer.nn.transformer.data_dependent_init(model, run) with run() one forward pass on a batch "
    "(kilolayer train does this)"
)


@SCHEMES.register()
class Admin(PostLN):
    """Admin: Post-LN with a learned per-channel shortcut scale omega (default or profiled start)."""

    name = "admin"
    learned_shortcut = True

    @property
    def profiled(self) -> bool:
        return self.options.get("admin_omega") == "profile"

    def omega(self, side: str) -> float:
        """The profile-free default omega of a side."""
        n = self.depth.sublayers(side)
        return math.sqrt((n + 1) / math.log(n + 1) - 1)

    def alpha(self, site):
        return self.omega(site.side)

    def describe(self):
        return {side: {"omega": self.alpha(Site(side, 0, "ffn"))} for side in self.depth.sides()}

    def outside_residual(self, site):
        parts = super().outside_residual(site)
        if self.profiled:
            parts.append("omega profiled on a batch through the backbone (admin_omega=profile)")
        return parts

    def attach(self, model):
        if self.profiled:
            model.__dict__["_admin_unprofiled"] = [
                model.register_forward_pre_hook(_refuse_training),
                model.register_load_state_dict_post_hook(_omega_loaded),
            ]

    def data_dependent_init(self, model, run):
        # weights that carried omega (resume, init_from) are already profiled: profiling again would overwrite them
        pending = "_admin_unprofiled" in model.__dict__
        return admin_profile(model, run) if self.profiled and pending else None


def _refuse_training(module: nn.Module, args) -> None:
    if module.training and torch.is_grad_enabled():
        raise ConfigError(UNPROFILED)


def _omega_loaded(module: nn.Module, incompatible_keys) -> None:
    if not any(key.endswith("shortcut.omega") for key in incompatible_keys.missing_keys):
        _mark_profiled(module)


def _mark_profiled(model: nn.Module) -> None:
    for m in model.modules():
        for handle in m.__dict__.pop("_admin_unprofiled", ()):
            handle.remove()


@torch.no_grad()
def admin_profile(model: nn.Module, run: Callable[[], object]) -> dict:
    """Admin's profiling pass: set every learned shortcut scale of ``model`` from measured variances.

    ``run`` runs one forward pass of ``model`` on a representative batch (in eval mode here). Forward hooks
    follow each side's chain (see the module docstring); returns the final ratio per side, {} if ``model`` has
    no learned shortcut.
    """
    residuals = [m for m in model.modules() if isinstance(m, Residual) and isinstance(m.shortcut, LearnedShortcut)]
    ratio: dict[str, float] = {}  # side -> the chain's ratio so far
    shortcut_input: dict[Residual, tuple[torch.Tensor, float]] = {}

    def set_omega(res: Residual):
        def hook(shortcut, args):
            r = ratio.get(res.site.side, 1.0)
            shortcut.omega.fill_(r)
            shortcut_input[res] = (args[0], r)

        return hook

    def measure(res: Residual):
        # the Residual's dropout output is the branch's addend, computed after its shortcut
        def hook(dropout, args, y):
            x, r = shortcut_input.pop(res)
            ratio[res.site.side] = math.sqrt(float((x * r).var()) + float(y.var()))

        return hook

    handles = [res.shortcut.register_forward_pre_hook(set_omega(res)) for res in residuals]
    handles += [res.dropout.register_forward_hook(measure(res)) for res in residuals]
    was_training = model.training
    model.eval()
    try:
        if residuals:
            run()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    _mark_profiled(model)
    return ratio
