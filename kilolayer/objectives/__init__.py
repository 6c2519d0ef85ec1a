"""Objectives: one module per objective, registered by name (``objective.name``).

Each module below registers its objective with ``@register_objective`` when it is imported; adding an
objective is its module plus one import line here.
"""

from __future__ import annotations

from kilolayer.data.base import Source
from kilolayer.errors import ConfigError
from kilolayer.objectives import causal_lm, classification, contrastive, mae, mlm, seq2seq  # noqa: F401 - register
from kilolayer.objectives.base import OBJECTIVES, Objective, Task, register_objective


def build_objective(config, backbone, source: Source | None) -> Objective:
    """The objective ``config.objective.name`` with its heads, checked against ``model.arch``, built for the data
    ``source`` it will be trained on (its classes, special ids, ...); ``source=None``: for its shapes alone (see
    :class:`Objective`)."""
    name = config.objective.name
    cls = OBJECTIVES.get(name)
    if cls.archs and config.model.arch not in cls.archs:
        raise ConfigError(f"model.arch={config.model.arch!r}: objective {name!r} needs model.arch in {list(cls.archs)}")
    return cls(config, backbone, source)


def build_task(config, source: Source | None) -> Task:
    """Backbone + objective for a full config, the objective built for ``source`` (``load_source(config)``, or
    None for a task that only needs its shapes: see :class:`Objective`)."""
    from kilolayer.nn.transformer import build_model

    backbone = build_model(config.model)
    return Task(backbone, build_objective(config, backbone, source))


__all__ = ["OBJECTIVES", "Objective", "Task", "register_objective", "build_objective", "build_task"]
