"""Validate a free ``options`` dict against a source's or objective's own pydantic model."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from kilolayer.config import format_validation_error
from kilolayer.errors import ConfigError


def parse_options(model: type[BaseModel], options: dict, prefix: str):
    try:
        return model.model_validate(options or {})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, prefix)) from None
