"""Data sources: one module per source, registered by name (``data.name``)."""

from __future__ import annotations

import importlib

from kilolayer.data.base import SOURCES, Source, register_source
from kilolayer.errors import ConfigError

# Importing a module registers its sources.
MODULES = [
    "kilolayer.data.stdlib",
    "kilolayer.data.synthetic",
    "kilolayer.data.digits",
    "kilolayer.data.images",
    "kilolayer.data.text",
    "kilolayer.data.hf_dataset",
    "kilolayer.data.mnist",
    "kilolayer.data.ptb",
    "kilolayer.data.parallel",
]


def load_source(config) -> Source:
    """The data source the config names, built for its model and seed."""
    for m in MODULES:
        importlib.import_module(m)
    name = config.data.name
    if name not in SOURCES:
        raise ConfigError(f"data.name={name!r}: unknown data source; allowed: {', '.join(sorted(SOURCES))}")
    return SOURCES[name](config)


__all__ = ["SOURCES", "Source", "register_source", "load_source"]
