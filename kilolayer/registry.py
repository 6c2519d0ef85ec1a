"""One registry helper for everything kilolayer looks up by name in a config or on the command line.

Residual schemes (``model.scheme``), objectives (``objective.name``), data sources (``data.name``), study
findings (``study.findings``) and built-in studies (``kilolayer study NAME``) are each a :class:`Registry`. A
plugin registers itself with a decorator where it is defined, and its package's ``__init__`` imports it, so
the edge is a plain import that a reader and a tool can both see::

    SCHEMES = Registry("model.scheme", "residual scheme")  # in this module, below

    @SCHEMES.register("deepnorm")
    class DeepNorm(Scheme): ...

    SCHEMES.get("deepnrom")  # ConfigError: model.scheme='deepnrom': unknown residual scheme; allowed: ...

A registry is a read-only mapping (``name in SCHEMES``, ``SCHEMES[name]``, ``sorted(SCHEMES)``), so code that
iterates the names needs nothing else.

The three registries a config names (:data:`SCHEMES`, :data:`OBJECTIVES`, :data:`SOURCES`) are declared here,
below :mod:`kilolayer.config`, so that config validates a name without importing the model, the objectives or
the data; their plugins fill them from above (``kilolayer.nn``, ``kilolayer.objectives``, ``kilolayer.data``),
and ``import kilolayer`` imports all three, so every built-in name is registered before any config is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Generic, TypeVar

from kilolayer.errors import ConfigError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Names -> plugins for one config field.

    ``field`` is the config key (or CLI argument) the name comes from and ``kind`` what a plugin is; both
    appear in the one-line error of :meth:`get`.
    """

    def __init__(self, field: str, kind: str):
        self.field = field
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str | None = None) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` (default: its ``name`` attribute).

        Registering a second, different object under a taken name is an error: one name, one plugin.
        """

        def deco(obj: T) -> T:
            key = name if name is not None else getattr(obj, "name", None)
            if not isinstance(key, str) or not key:
                raise TypeError(f"{obj!r}: registering in {self.field} needs a name (argument or .name attribute)")
            old = self._items.get(key)
            if old is not None and old is not obj and _qualname(old) != _qualname(obj):
                raise ValueError(f"{self.field}: {key!r} is already registered to {_qualname(old)}")
            self._items[key] = obj
            return obj

        return deco

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name`` without a decorator."""
        return self.register(name)(obj)

    @contextmanager
    def added(self, name: str, obj: T) -> Iterator[T]:
        """``with registry.added(name, obj):`` registers ``obj`` for the block only (a test's own plugin)."""
        if name in self._items:
            raise ValueError(f"{self.field}: {name!r} is already registered to {_qualname(self._items[name])}")
        self.add(name, obj)
        try:
            yield obj
        finally:
            del self._items[name]

    def get(self, name: str) -> T:  # type: ignore[override]  # Mapping.get's default is never wanted here
        """The plugin called ``name``, or a :class:`ConfigError` naming the field, the value and what is allowed."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ConfigError(self.unknown(name)) from None

    def unknown(self, name: object, field: str | None = None) -> str:
        """The one-line message for a name that is not registered; ``field`` names another config key that
        takes the same kind of name (e.g. MAE's ``objective.options.decoder_scheme``)."""
        return f"{field or self.field}={name!r}: unknown {self.kind}; allowed: {', '.join(self.names())}"

    def names(self) -> list[str]:
        """The registered names, sorted (the order every "allowed: ..." lists them in)."""
        return sorted(self._items)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.field!r}: {', '.join(self.names())})"


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


# the registries of the names a config gives; filled by the modules that define the plugins
SCHEMES: Registry = Registry("model.scheme", "residual scheme")
OBJECTIVES: Registry = Registry("objective.name", "objective")
SOURCES: Registry = Registry("data.name", "data source")
