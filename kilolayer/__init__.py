"""kilolayer: configure, train and diagnose deep Transformers (DeepNet's DeepNorm, Bamboo's depth-vs-width)."""

# the objectives and data sources register their names for config validation (kilolayer.registry)
from kilolayer import data, objectives  # noqa: F401
from kilolayer.config import Config, ModelConfig, load_config
from kilolayer.errors import ConfigError, InputError, KilolayerError
from kilolayer.nn.budget import budget, count_parameters, matched_configs, training_flops
from kilolayer.nn.custom import init_branches, residual, residual_scheme
from kilolayer.nn.deepnorm import deepnorm_constants
from kilolayer.nn.residual import SCHEMES
from kilolayer.nn.transformer import build_model

__version__ = "0.1.0"


def load(path, device: str = "cpu", checkpoint=None):
    """The trained model in ``path`` (a run directory or a folder ``kilolayer export`` wrote) as a
    :class:`kilolayer.train.trained.Trained`: ``.task``, ``.config``, ``.encode``, ``.decode``, ``.generate``,
    ``.export`` (docs/models.md#load-generate-export)."""
    from kilolayer.train.trained import load as load_trained  # the trainer's modules load only when used

    return load_trained(path, device, checkpoint)


__all__ = [
    "Config",
    "ModelConfig",
    "load_config",
    "ConfigError",
    "InputError",
    "KilolayerError",
    "budget",
    "count_parameters",
    "matched_configs",
    "training_flops",
    "deepnorm_constants",
    "residual_scheme",
    "residual",
    "init_branches",
    "SCHEMES",
    "build_model",
    "load",
]
