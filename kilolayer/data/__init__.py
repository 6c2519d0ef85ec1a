"""Data sources: one module per source, registered by name (``data.name``).

Each module below registers its sources with ``@register_source(name)`` when it is imported; adding a source is
its module plus one import line here.
"""

from __future__ import annotations

from kilolayer.data import (  # noqa: F401
    digits,
    hf_dataset,
    images,
    lo_help,
    lo_multi,
    mnist,
    parallel,
    ptb,
    stdlib,
    synthetic,
    text,
)
from kilolayer.data.base import SOURCES, Source, register_source


def load_source(config) -> Source:
    """The data source the config names, built for its model and seed."""
    return SOURCES.get(config.data.name)(config)


__all__ = ["SOURCES", "Source", "register_source", "load_source"]
