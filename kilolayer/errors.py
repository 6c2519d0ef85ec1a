"""User-facing errors: one line that names the field or path and what was expected."""

from __future__ import annotations


class KilolayerError(ValueError):
    """An error the user caused (bad config, bad file, bad input shape).

    The CLI prints ``kilolayer: error: <message>`` and exits non-zero, never a
    traceback. The message must be a single line.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class ConfigError(KilolayerError):
    """A bad configuration value."""


class InputError(KilolayerError):
    """A tensor or file handed to kilolayer has the wrong shape, dtype or content."""


class PluginError(KilolayerError):
    """An installed package's entry point in one of kilolayer's groups does not load (kilolayer.registry)."""


class DivergedError(KilolayerError):
    """Training diverged. A result, not a crash: exit code 3."""

    exit_code = 3
