"""The built-in studies of ``kilolayer study NAME``: one spec per study, ``kilolayer/studies/NAME.yaml`` (package
data), read by its file name. A YAML file there is a built-in study; nothing else registers it.

The built-in claims (``kilolayer/studies/claims/*.yaml``) read groups by name, which a spec may rebind: ``deepnet``
(schemes x depths); ``deeper`` and ``wide`` (a deep, narrow model against a shallow, wide one of more parameters);
``depth_gradients`` (early gradients across depths); ``robust_lr``, ``robust_batch`` and
``robust_width`` (one setting raised at a time); on images ``untrained``, ``supervised``, ``contrastive``, ``mae`` and
``finetune`` (MAE then fine-tuning); on text ``text_untrained``, ``text_classify``, ``mlm``,
``mlm_finetune`` and ``next_token``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.resources import files

from kilolayer.config import load_yaml
from kilolayer.registry import Registry

STUDIES = files("kilolayer") / "studies"
# `kilolayer study --list` shows these first, in this order, then any other study by name
LISTED = (
    "quick",
    "deepnet",
    "deepnet_1000",
    "deepnet_analysis",
    "deepnet_robust",
    "bamboo",
    "bamboo_cpu",
    "deepnet_mt",
    "deepnet_mt_slice",
    "deepnet_mt_depth",
    "deepnet_multilingual",
    "deepnet_multilingual_cpu",
)


def _unshared(x):
    """``x`` with no part shared: a YAML alias loads as one object, and a caller may edit one group's copy."""
    if isinstance(x, dict):
        return {k: _unshared(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unshared(v) for v in x]
    return x


class _Study:
    """Calling it reads ``kilolayer/studies/NAME.yaml`` and returns the spec, a new dict every time."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self) -> dict:
        return _unshared(load_yaml((STUDIES / f"{self.name}.yaml").read_text(encoding="utf-8")))


@functools.lru_cache(maxsize=16)
def _parsed(text: str) -> dict:
    """A claims file's YAML, parsed once per text (every spec that names claims reads them; callers copy)."""
    return load_yaml(text)


def _claim_files() -> dict:
    found: dict = {}
    for path in sorted((STUDIES / "claims").iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml"):
            found.update(_parsed(path.read_text(encoding="utf-8")))
    return found


def builtin_claims() -> dict[str, dict]:
    """The built-in claims by name: ``kilolayer/studies/claims/*.yaml``, each a mapping of name -> claim. A spec
    names one in its ``claims:`` list (or ``{use: NAME, ...}`` with fields of its own)."""
    return {name: {"name": name, **_unshared(body)} for name, body in _claim_files().items() if isinstance(body, dict)}


def builtin_claim_sets() -> dict[str, list[str]]:
    """Names that stand for several built-in claims (a paper's claim measured on several pairs or modalities, one
    verdict each): name -> the claims' names."""
    return {name: list(body) for name, body in _claim_files().items() if isinstance(body, list)}


# name -> a function returning the spec (a dict)
BUILTIN: Registry[Callable[[], dict]] = Registry("study", "built-in study")
_names = [p.name.removesuffix(".yaml") for p in STUDIES.iterdir() if p.name.endswith(".yaml")]
for _name in sorted(_names, key=lambda n: (LISTED.index(n) if n in LISTED else len(LISTED), n)):
    BUILTIN.add(_name, _Study(_name))
