"""The shapes a search races: one parameter-matched model per depth, at the width, heads and FFN closest to the
budget (:func:`shapes`, :func:`closest_shape`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kilolayer.config import Config, ModelConfig, load_config
from kilolayer.errors import ConfigError
from kilolayer.nn.budget import count_parameters, training_flops


@dataclass(frozen=True)
class Shape:
    """One parameter-matched model: its name (``LAYERSxWIDTH``), config, parameters, training FLOPs per token, and
    its parameters' deviation from the budget (``parameters / budget - 1``)."""

    name: str
    model: ModelConfig
    parameters: int
    flops_per_token: float
    deviation: float = 0.0

    @property
    def layers(self) -> int:
        return self.model.layers

    @property
    def head_size(self) -> int:
        return self.model.width // self.model.heads

    def step_flops(self, batch_size: int) -> float:
        """Model FLOPs of one training step at the model's full length (:func:`kilolayer.nn.budget.training_flops`)."""
        return training_flops(self.model) * batch_size


def shape_name(model: ModelConfig) -> str:
    if model.arch == "encoder_decoder":
        return f"{model.layers}+{model.decoder_layers}x{model.width}"
    return f"{model.layers}x{model.width}"


MAX_WIDTH = 8192


def default_depths(model: ModelConfig) -> tuple[int, int]:
    """The depth range without ``--depths``: half to twice the config's depth."""
    return max(1, model.layers // 2), 2 * model.layers


def _shaped(m: ModelConfig, layers: int, heads: int, head_size: int, ffn: int) -> ModelConfig:
    data = m.model_dump()
    data.update(layers=layers, width=heads * head_size, heads=heads, ffn=max(1, ffn))
    if m.arch == "encoder_decoder":  # the config's decoder-to-encoder ratio
        data["decoder_layers"] = max(1, round(layers * m.decoder_layers / m.layers))
    return ModelConfig.model_validate(data)


def _head_sizes(m: ModelConfig) -> range:
    """Half to twice the config's head size, in steps of an eighth of it."""
    head = m.width // m.heads
    step = max(1, head // 8)
    return range(max(step, head // 2 // step * step), 2 * head + 1, step)


def narrowest(m: ModelConfig, layers: int) -> ModelConfig:
    """The smallest model :func:`closest_shape` considers at ``layers``: one head of the smallest head size, half
    the FFN ratio."""
    q = _head_sizes(m)[0]
    return _shaped(m, layers, 1, q, max(1, round(m.ffn / m.width * q) // 2))


def closest_shape(m: ModelConfig, layers: int, params: int, tolerance: float) -> ModelConfig:
    """The model like ``m`` at ``layers`` whose width, heads and FFN bring it closest to ``params``: of the shapes
    within ``tolerance``, the one least changed from the config's head size and FFN ratio (the sum of the two
    factors' |ln|), then the smallest deviation; with none within ``tolerance``, the closest one. Head sizes range
    over half to twice the config's (in steps of an eighth of it) and widths are heads x head size; the FFN is
    the config's ratio, or, where that does not come within ``tolerance``, the size that comes closest (half to
    twice the ratio's)."""
    head = m.width // m.heads
    ratio = m.ffn / m.width
    best = None

    def count(h: int, q: int, ffn: int | None = None) -> int:
        return count_parameters(_shaped(m, layers, h, q, round(ratio * h * q) if ffn is None else ffn))

    for q in _head_sizes(m):
        lo, hi = 1, max(1, MAX_WIDTH // q)
        while lo < hi:  # the fewest heads at or over the budget: parameters grow with width
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if count(mid, q) < params else (lo, mid)
        for h in {max(1, lo - 1), lo}:
            held = round(ratio * h * q)
            sizes = [held]
            base, more = count(h, q, held), count(h, q, held + 1)
            if abs(base - params) > tolerance * params and more > base:  # parameters are linear in the FFN size
                fitted = held + round((params - base) / (more - base))
                sizes.append(min(max(fitted, max(1, held // 2)), 2 * held))
            for ffn in sizes:
                c = _shaped(m, layers, h, q, ffn)
                dev = abs(count_parameters(c) - params) / params
                change = abs(math.log(q / head)) + abs(math.log(max(1, ffn) / max(1, held)))
                key = (0, change, dev) if dev <= tolerance else (1, dev, change)
                if best is None or key < best[0]:
                    best = (key, c)
    return best[1]


def shapes(config: Config, params: int, depths: tuple[int, int] | None = None, tolerance: float = 0.03) -> list[Shape]:
    """One shape like ``config.model`` per depth in ``depths`` = (A, B) inclusive (default
    :func:`default_depths`), at the width, heads and FFN closest to ``params`` parameters
    (:func:`closest_shape`), shallowest first; each with its deviation from ``params``, which may exceed
    ``tolerance`` where no shape at that depth comes within it. The depths from the first whose
    :func:`narrowest` model exceeds ``params`` by more than ``tolerance`` on are left out (deeper is larger)."""
    from kilolayer.nn.budget import budget

    lo, hi = depths or default_depths(config.model)
    out = []
    for layers in range(lo, hi + 1):
        if count_parameters(narrowest(config.model, layers)) > params * (1 + tolerance):
            break
        c = closest_shape(config.model, layers, params, tolerance)
        n = count_parameters(c)
        out.append(Shape(shape_name(c), c, n, budget(c).flops_per_token, n / params - 1))
    return out


def parse_depths(text: str) -> tuple[int, int]:
    """``A..B`` (inclusive, 1 <= A <= B) for ``--depths``."""
    a, sep, b = text.partition("..")
    try:
        lo, hi = int(a), int(b)
    except ValueError:
        lo = hi = 0
    if not sep or not 1 <= lo <= hi:
        raise ConfigError(f"--depths {text!r}: expected A..B with 1 <= A <= B, e.g. 2..24")
    return lo, hi


def trial_config(config: Config, shape: Shape, lr: float) -> Config:
    """``config`` with the shape's model and learning rate ``lr``."""
    data = config.model_dump()
    data["model"] = shape.model.model_dump()
    data["train"] = {**data["train"], "lr": lr}
    return load_config(data)


def percent(x: float) -> str:
    """A fraction as a percentage with the digits it needs (0.0001 -> 0.01%, 0.03 -> 3%)."""
    return f"{x * 100:.3g}%"
