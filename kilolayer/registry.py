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

A registry with an entry-point ``group`` also holds what other installed packages declare there (in their
``pyproject.toml``: ``[project.entry-points."kilolayer.schemes"]``, ``my_scheme = "my_pkg.schemes:MyScheme"``).
An entry point names one object, which is registered under the entry point's name. They are loaded once, the
first time the registry is asked for a name it does not hold or for all its names, so ``import kilolayer``
imports no plugin. A plugin that fails to load is a :class:`PluginError` naming the entry point, its package and
the error when the names are listed; a name not found is the registry's "unknown" error (a typo is the likelier
cause), with the plugins that failed to load as its note.

The three registries a config names (:data:`SCHEMES`, :data:`OBJECTIVES`, :data:`SOURCES`) are declared here,
below :mod:`kilolayer.config`, so that config validates a name without importing the model, the objectives or
the data; their plugins fill them from above (``kilolayer.nn``, ``kilolayer.objectives``, ``kilolayer.data``),
and ``import kilolayer`` imports all three, so every built-in name is registered before any config is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from importlib import metadata
from types import ModuleType
from typing import Generic, TypeVar

from kilolayer.errors import ConfigError, PluginError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Names -> plugins for one config field.

    ``field`` is the config key (or CLI argument) the name comes from and ``kind`` what a plugin is; both
    appear in the one-line error of :meth:`get`. ``group`` is the entry-point group other packages register in
    (None: built-in plugins only).
    """

    def __init__(self, field: str, kind: str, group: str | None = None):
        self.field = field
        self.kind = kind
        self.group = group
        self._items: dict[str, T] = {}
        self._loaded = group is None
        self._broken: list[str] = []  # one line per entry point that failed to load

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
            return self[name]
        except (KeyError, TypeError):
            raise ConfigError(self.unknown(name)) from None

    def unknown(self, name: object, field: str | None = None) -> str:
        """The one-line message for a name that is not registered; ``field`` names another config key that
        takes the same kind of name (e.g. MAE's ``objective.options.decoder_scheme``)."""
        try:
            names = self.names()
        except PluginError:  # the names that did register; the broken plug-ins are the note below
            names = sorted(self._items)
        allowed = f"allowed: {', '.join(names)}" if names else "none is registered (a plug-in registers one)"
        note = f" (note: a plug-in did not load: {'; '.join(self._broken)})" if self._broken else ""
        return f"{field or self.field}={name!r}: unknown {self.kind}; {allowed}{note}"

    def names(self) -> list[str]:
        """The registered names, sorted (the order every "allowed: ..." lists them in)."""
        return sorted(self)

    def load_plugins(self) -> None:
        """Register the objects of the group's entry points (once); a :class:`PluginError` while any failed."""
        if not self._loaded:
            self._loaded = True  # first: a plugin that looks up a name while it loads must not load the group again
            for ep in metadata.entry_points(group=self.group):
                try:
                    obj = ep.load()
                    if isinstance(obj, ModuleType):
                        raise TypeError("it names a module; name the object to register (module:object)")
                    own = getattr(obj, "name", None)
                    if isinstance(own, str) and own and own != ep.name:
                        raise ValueError(f"the object's name is {own!r}; the entry point must have the same name")
                    self.add(ep.name, obj)
                except Exception as err:
                    dist = getattr(ep, "dist", None)
                    package = f"{dist.name} {dist.version}" if dist is not None else "no installed package"
                    error = " ".join(f"{type(err).__name__}: {err}".split())
                    self._broken.append(f"{self.group} entry point {ep.name} = {ep.value} ({package}): {error}")
        if self._broken:
            raise PluginError("; ".join(self._broken))

    def __getitem__(self, name: str) -> T:
        if name not in self._items and not self._loaded:
            # a name still missing is a KeyError, which get() and config validation report as an unknown name
            # (a typo is the likelier cause) with the broken plug-ins as its note; a listing raises PluginError
            with suppress(PluginError):
                self.load_plugins()
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        self.load_plugins()
        return iter(self._items)

    def __len__(self) -> int:
        self.load_plugins()
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.field!r}: {', '.join(sorted(self._items))})"


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


# the registries of the names a config gives; filled by the modules that define the plugins and by other packages'
# entry points
SCHEMES: Registry = Registry("model.scheme", "residual scheme", group="kilolayer.schemes")
OBJECTIVES: Registry = Registry("objective.name", "objective", group="kilolayer.objectives")
SOURCES: Registry = Registry("data.name", "data source", group="kilolayer.sources")
