"""Configs: pydantic models for every section, YAML in/out, ``--set`` overrides.

A config has four sections, ``model``, ``objective``, ``data`` and ``train``.
Every field is validated; a bad value becomes one line naming the field, the
value and what is allowed (see :func:`format_validation_error`).

Names of plugins (``model.scheme``, ``objective.name``, ``data.name``) are
checked against their registry (:mod:`kilolayer.registry`), the one list of
what exists, so adding a scheme, an objective or a data source touches only its
own package. The registries are declared below this module and filled by the
plugins' packages, which ``import kilolayer`` loads; this module imports no
model, objective or data code. Checking at validation time rather than at build
time keeps the error where the value was given: ``kilolayer train`` refuses
before it creates a run directory, and a study rejects a bad grid point before
it trains any.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import types
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kilolayer.errors import ConfigError
from kilolayer.registry import OBJECTIVES, SCHEMES, SOURCES

Arch = Literal["encoder", "decoder", "encoder_decoder"]
#: the most intra-op threads ``train.threads`` may ask for (torch takes a C int; no machine here has more cores)
MAX_THREADS = 1024


def _bool_for_number(value: Any, annotation: Any) -> bool:
    """Whether ``value`` holds a bool where ``annotation`` wants a number: the value itself (``int``,
    ``float | None``, ``Literal[0, 1]``), or an item of a list, tuple, set or dict value it types
    (``tuple[float, float]``, ``list[int]``, ``dict[str, float]``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _bool_for_number(value, args[0])
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, bool):
            return bool not in args and any(_bool_for_number(value, a) for a in args)
        return any(_bool_for_number(value, a) for a in args if a is not type(None))
    if isinstance(value, bool):
        if origin is typing.Literal:
            return not any(isinstance(a, bool) for a in args) and any(isinstance(a, (int, float)) for a in args)
        return annotation in (int, float)
    if origin in (list, set, frozenset) and args and isinstance(value, (list, tuple, set)):
        return any(_bool_for_number(v, args[0]) for v in value)
    if origin is tuple and args and isinstance(value, (list, tuple)):
        if len(args) == 2 and args[1] is Ellipsis:
            return any(_bool_for_number(v, args[0]) for v in value)
        return any(_bool_for_number(v, a) for v, a in zip(value, args))
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return any(_bool_for_number(v, args[1]) for v in value.values())
    return False


class NumbersNotBools(BaseModel):
    """A base for config models: ``true``/``false`` given for a number, or inside a list, tuple or mapping of
    numbers, is refused. Pydantic would read them as 1 and 0, so ``train.steps: true`` would train one step
    and ``train.peak_flops: true`` divide by 1 FLOP/s."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _bool_for_number(value, field.annotation):
            shown = str(value).lower() if isinstance(value, bool) else "true/false"
            raise PydanticCustomError("bool_number", "expected a number, not {value}", {"value": shown})
        return value


class _Section(NumbersNotBools):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The backbone: stacks, widths, residual scheme and input embedding."""

    arch: Arch = "encoder"
    scheme: str = "pre_ln"
    layers: int = Field(6, ge=1, description="encoder layers, or the layers of a decoder-only model")
    decoder_layers: int = Field(0, ge=0, description="decoder layers (encoder_decoder only)")
    width: int = Field(256, ge=1)
    heads: int = Field(4, ge=1)
    ffn: int = Field(1024, ge=1)
    activation: Literal["gelu", "relu"] = "gelu"
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = True
    norm_eps: float = Field(1e-5, gt=0)
    # inputs
    input: Literal["tokens", "patches"] = "tokens"
    vocab_size: int = Field(256, ge=2, description="token vocabulary (both sides of an encoder-decoder)")
    max_len: int = Field(512, ge=1, description="longest token sequence the positions cover")
    positions: Literal["learned", "sinusoidal", "none"] = "learned"
    embed_scale: bool = False
    image_size: int = Field(32, ge=1)
    patch_size: int = Field(4, ge=1)
    channels: int = Field(3, ge=1)
    cls_token: bool = True
    # scheme options (ignored by schemes that do not use them)
    layerscale_init: float | None = Field(None, gt=0, description="LayerScale gain; default by depth as CaiT")
    ds_init_variant: Literal["paper", "code"] = "paper"
    admin_omega: Literal["default", "profile"] = "default"
    branchnorm_steps: int = Field(4000, ge=1, description="BranchNorm's T: updates until it is plain Post-LN")
    # speed options (the model's numbers do not depend on them beyond dtype rounding)
    checkpoint_activations: bool = False
    cpu_attention: Literal["auto", "fp32", "sdpa"] = Field(
        "auto",
        description="on a CPU under bf16/fp16 autocast: auto (bf16 matrix products around an fp32 softmax up to 256 "
        "keys, fp32 SDPA beyond and in fp16), fp32 (SDPA in fp32) or sdpa (SDPA in the autocast dtype) "
        "(kilolayer.nn.attention)",
    )

    @model_validator(mode="before")
    @classmethod
    def _attention_fp32_cpu(cls, data: Any) -> Any:
        # the switch's boolean form, which older run directories' configs hold: true attended in fp32, false
        # through SDPA in the autocast dtype; read as such so that those runs resume with the same numbers
        if isinstance(data, dict) and "attention_fp32_cpu" in data:
            data = dict(data)
            flag = data.pop("attention_fp32_cpu")
            if not isinstance(flag, bool):
                raise ValueError(f"model.attention_fp32_cpu={flag!r}: expected true or false (or model.cpu_attention)")
            if "cpu_attention" in data:
                raise ValueError("model.attention_fp32_cpu: give model.cpu_attention alone")
            data["cpu_attention"] = "fp32" if flag else "sdpa"
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.scheme not in SCHEMES:
            raise ValueError(SCHEMES.unknown(self.scheme))
        if self.width % self.heads:
            raise ValueError(f"model.width={self.width}: must be divisible by model.heads={self.heads}")
        if self.arch == "encoder_decoder" and self.decoder_layers < 1:
            raise ValueError("model.decoder_layers=0: an encoder_decoder needs at least 1 decoder layer")
        if self.arch != "encoder_decoder" and self.decoder_layers:
            raise ValueError(
                f"model.decoder_layers={self.decoder_layers}: only an encoder_decoder has decoder layers "
                f"(model.arch={self.arch!r}; use model.layers)"
            )
        if self.input == "patches":
            if self.arch != "encoder":
                raise ValueError(
                    f"model.input='patches': only an encoder takes image patches (model.arch={self.arch!r})"
                )
            if self.image_size % self.patch_size:
                raise ValueError(
                    f"model.image_size={self.image_size}: must be divisible by model.patch_size={self.patch_size}"
                )
        return self

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def encoder_depth(self) -> int:
        """Layers in the encoder stack (0 without one); ``model.layers`` of an encoder or encoder-decoder."""
        return self.layers if self.arch in ("encoder", "encoder_decoder") else 0

    @property
    def decoder_depth(self) -> int:
        """Layers in the decoder stack (0 without one): ``model.layers`` of a decoder-only model,
        ``model.decoder_layers`` of an encoder-decoder."""
        if self.arch == "decoder":
            return self.layers
        return self.decoder_layers if self.arch == "encoder_decoder" else 0

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens one sample gives the encoder/decoder at full length."""
        if self.input == "patches":
            return self.num_patches + int(self.cls_token)
        return self.max_len


class ObjectiveConfig(_Section):
    """What the backbone is trained to do; options apply to the named objective."""

    name: str = Field("causal_lm", description="a registered objective (kilolayer.objectives.OBJECTIVES)")
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        OBJECTIVES.get(name)  # the registry's one-line error (a ConfigError is a ValueError)
        return name


class DataConfig(_Section):
    """Where batches come from: a built-in source or a user's path."""

    name: str = Field("stdlib_bytes", description="a registered data source (kilolayer.data.SOURCES)")
    task: Literal["copy", "reverse", "sort", "add"] = "reverse"
    path: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        SOURCES.get(name)
        return name


class TrainConfig(_Section):
    """The training loop."""

    steps: int = Field(100, ge=0, description="optimizer steps (kilolayer train needs at least 1 but untrained)")
    untrained: bool = Field(
        False,
        description="an untrained baseline: the freshly initialised model saved as the run, at step 0 (train.steps "
        "is 0 whatever it is given)",
    )
    batch_size: int = Field(16, ge=1, description="global batch (all processes, all accumulation steps)")
    accumulate: int = Field(1, ge=1, description="gradient accumulation: micro-batches per step")
    lr: float = Field(5e-4, gt=0, allow_inf_nan=False)
    warmup: int = Field(0, ge=0)
    schedule: Literal["constant", "inverse_sqrt", "cosine"] = "inverse_sqrt"
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine: final lr as a fraction of lr")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.98)
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.01, ge=0, allow_inf_nan=False)
    clip: float = Field(1.0, ge=0, description="gradient-norm clipping (0 = off)")
    seed: int = 0
    eval_every: int = Field(0, ge=0, description="0 = only at the end")
    eval_batches: int = Field(8, ge=1, description="evaluation batches each time")
    checkpoint_every: int = Field(0, ge=0, description="0 = only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(10, ge=1)
    precision: Literal["fp32", "bf16", "auto"] = Field(
        "fp32",
        description="the steps' precision: fp32, bf16 (autocast), or auto: bf16 where this machine has bf16 "
        "instructions and the run's training step runs at least 1.05x as fast in it, else fp32, decided once at "
        "the run's start (once for all the runs of a study or search) and kept on resume "
        "(kilolayer.train.host.precision)",
    )
    compile: Literal[False, "layers", "model"] = Field(
        False,
        description="torch.compile: false (eager), layers (each Transformer layer, the objective's towers' too; "
        "true means this) or model (the whole task: backbone, heads and loss, once)",
    )
    fused_optimizer: bool = Field(False, description="AdamW(fused=True) instead of the multi-tensor (foreach) path")
    trim_heap_every: int = Field(
        32,
        ge=0,
        strict=True,  # an integer, not `true` (which would read as 1: a trim after every layer)
        description="with activation checkpointing: hand the heap's free pages back every this many layers; "
        "0: never (kilolayer.train.host.heap)",
    )
    pin_mmap: bool = Field(
        False,
        description="with activation checkpointing: pin glibc's mmap threshold at 64 KiB (kilolayer.train.host.heap)",
    )
    hold_heap: bool = Field(
        True,
        description="on the CPU with no layer checkpointed: keep the memory a step frees for the next "
        "(kilolayer.train.host.heap)",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | Literal["auto"] | None = Field(
        None,
        description="intra-op threads of the training process: a count, fixed for the run (default: "
        "OMP_NUM_THREADS if set, else every usable core, kilolayer.train.host.threads; a resume reuses the count its "
        "run recorded, since float reductions, and so bit-exact losses, follow it); or auto: follow the machine's "
        "load during the run (not bit-reproducible)",
    )
    parallel: Literal["none", "ddp", "fsdp"] = Field("ddp", description="used only under torchrun")
    diverge_factor: float = Field(
        10.0, gt=1, description="diverged if the smoothed loss exceeds factor x its running minimum after warm-up ..."
    )
    diverge_increase: float = Field(
        1.0, ge=0, description="... and also exceeds that minimum by this much (so a loss near 0 may fluctuate)"
    )
    diagnostics_every: int = Field(0, ge=0, description="log DeepNet's stability diagnostics every K steps (0 = off)")
    diagnostics_until: int = Field(0, ge=0, description="stop diagnostics after this step (0 = never)")
    init_from: str | None = Field(None, description="a run directory whose backbone weights to start from")
    freeze_backbone: bool = Field(False, description="with init_from: train only the objective's head (linear probe)")
    memory_check: bool = Field(True, description="refuse a config whose estimated memory exceeds what the device has")
    peak_flops: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="the device's peak FLOP/s for MFU (default: the vendor figure of a known GPU, else measured)",
    )
    patience: int = Field(0, ge=0, description="early stopping: evaluations without improvement, then stop (0 = off)")
    min_delta: float = Field(0.0, ge=0, allow_inf_nan=False, description="early stopping: the smallest improvement")
    early_stop_metric: str = Field("loss", min_length=1, description="early stopping: an evaluation metric")
    early_stop_mode: Literal["auto", "min", "max"] = Field(
        "auto",
        description="early stopping: lower (min) or higher (max) is better; auto: max for accuracy, "
        "exact_match, bleu and chrf (and their intervals' ends), else min",
    )

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> Any:
        if value is None or value == "auto" or (type(value) is int and 1 <= value <= MAX_THREADS):
            return value
        raise ValueError(f"train.threads={value!r}: expected a thread count from 1 to {MAX_THREADS}, or auto")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_mode(cls, value: Any) -> Any:
        # true (a plain yes) means the per-layer mode
        if value is True:
            return "layers"
        if value is False or (isinstance(value, str) and value in ("layers", "model")):
            return value
        raise ValueError(f"train.compile={value!r}: expected false, layers or model (true means layers)")

    @model_validator(mode="before")
    @classmethod
    def _untrained_trains_no_step(cls, data: Any) -> Any:
        # an untrained baseline trains no step whatever train.steps says: a study's --set train.steps=N shortens
        # the training of its other groups and leaves its baselines untrained
        if isinstance(data, dict) and data.get("untrained") is True:
            return {**data, "steps": 0}
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.batch_size % self.accumulate:
            raise ValueError(
                f"train.batch_size={self.batch_size}: must be divisible by train.accumulate={self.accumulate}"
            )
        if self.untrained and self.steps:
            raise ValueError(
                f"train.untrained=true: an untrained baseline trains no step; expected train.steps: 0, not {self.steps}"
            )
        if self.freeze_backbone and not self.init_from:
            raise ValueError("train.freeze_backbone=true: needs train.init_from (a pretrained run directory)")
        return self


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)


# ---------------------------------------------------------------- errors


def _section_keys(cls: type | None, path: tuple) -> list[str] | None:
    """The keys a nested section of ``cls`` accepts (``path`` names the section), or None if unknown."""
    for part in path:
        field = cls.model_fields.get(str(part)) if cls is not None else None
        cls = field.annotation if field is not None else None
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
    return list(cls.model_fields) if cls is not None else None


def format_validation_error(err: ValidationError, prefix: str = "", cls: type | None = None) -> str:
    """One line for the first problem pydantic found: field path, bad value, what is allowed.

    ``cls`` (the validated model) lets an unknown key list the keys its section accepts.
    """
    e = err.errors()[0]
    parts = tuple(p for p in e.get("loc", ()) if p != "__root__")
    loc = ".".join(str(p) for p in parts)
    where = ".".join(p for p in (prefix, loc) if p)
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        # our own validators already name the field; a nested one (a study group's grid) gets where it sits
        msg = msg[len("Value error, ") :]
        if len(parts) > 1 and msg.startswith(f"{parts[-1]}."):
            return ".".join(str(p) for p in (prefix, *parts[:-1]) if p != "") + "." + msg
        return msg
    if e.get("type") == "extra_forbidden":
        keys = _section_keys(cls, parts[:-1])
        if not keys:
            return f"{where}: unknown key"
        near = difflib.get_close_matches(str(parts[-1]), keys, n=1)
        section = ".".join(p for p in (prefix, *map(str, parts[:-1])) if p)
        hint = f" did you mean {'.'.join(p for p in (section, near[0]) if p)}?" if near else ""
        return f"{where}: unknown key;{hint} allowed: {', '.join(keys)}"
    value = e.get("input")
    shown = f"={value!r}" if not isinstance(value, (dict, list)) or len(repr(value)) <= 40 else ""
    return f"{where}{shown}: {msg[0].lower() + msg[1:]}"


def _validate(cls, data: Any, prefix: str):
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, prefix, cls)) from None


def model_config(cfg: ModelConfig | dict) -> ModelConfig:
    """Accept the ``model`` section as a dict or a ModelConfig and validate it."""
    if isinstance(cfg, ModelConfig):
        return cfg
    if not isinstance(cfg, dict):
        raise ConfigError(f"model: expected a mapping or ModelConfig, got {type(cfg).__name__}")
    return _validate(ModelConfig, cfg, "model")


# ---------------------------------------------------------------- YAML and --set


#: PyYAML's C classes (libyaml, in every wheel PyPI ships for Linux, macOS and Windows) parse and write about ten
#: times faster than its pure-Python ones, which stand in where PyYAML was built without libyaml
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Strict:
    """A safe loader's mapping constructor that refuses a key given twice (see :class:`YamlLoader`)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode) and not getattr(node, "keys_checked", False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
            node.keys_checked = True
        return super().construct_mapping(node, deep)


class YamlLoader(_Strict, _SAFE_LOADER):
    """PyYAML's safe loader, reading numbers as YAML 1.2 does: its YAML 1.1 resolver takes a float only with a dot
    (``1.0e-3``), so ``1e-3`` or ``5E4`` would load as strings; here they are floats. A key given twice in one
    mapping is an error, as YAML 1.2 says, not the last one silently winning (a merge key's ``<<:`` values may be
    overridden)."""


class _PythonYamlLoader(_Strict, yaml.SafeLoader):
    """:class:`YamlLoader` on PyYAML's pure-Python parser, whose errors name more (the tab found, the alias
    undefined): :func:`load_yaml` reads a text again with it when the C parser refuses the text."""


class YamlDumper(_SAFE_DUMPER):
    """PyYAML's safe dumper, quoting a string that :class:`YamlLoader` reads as a number (``'1e3'``), so what it
    writes loads back as it was."""


for _cls in (YamlLoader, _PythonYamlLoader, YamlDumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )


def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML by :class:`YamlLoader` (safe: plain data only; ``1e-3`` a float); a text it refuses
    raises the pure-Python parser's error, which says more."""
    try:
        return yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError as err:
        if _SAFE_LOADER is yaml.SafeLoader:  # the text was read by the pure-Python parser already
            raise
        try:
            yaml.load(text, Loader=_PythonYamlLoader)
        except yaml.YAMLError as detailed:
            raise detailed from None
        raise err


def to_yaml(data: Any, **options) -> str:
    """``data`` as YAML that :func:`load_yaml` reads back as it was (``options``: :func:`yaml.dump`'s)."""
    return yaml.dump(data, Dumper=YamlDumper, **options)


def parse_set(item: str) -> tuple[list[str], Any]:
    """``key.path=value`` -> (["key", "path"], value parsed as YAML scalar)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"--set {item!r}: empty key segment")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_sets(data: dict, sets: list[str]) -> dict:
    """Return a copy of ``data`` with each ``key.path=value`` applied."""
    out = copy.deepcopy(data)
    for item in sets:
        path, value = parse_set(item)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(path[: i + 1])} is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _looks_like_a_name(source: str | Path) -> bool:
    """A missing source with no directory part and no YAML suffix was meant as a preset name."""
    p = Path(source)
    return not p.exists() and len(p.parts) == 1 and p.suffix.lower() not in (".yaml", ".yml", ".json")


def _source(data: dict):
    """The registered function of the source a config mapping names (None for a name validation will refuse)."""
    section = data.get("data") if isinstance(data.get("data"), dict) else {}
    name = section.get("name", DataConfig.model_fields["name"].default)
    return SOURCES[name] if isinstance(name, str) and name in SOURCES else None


def absolute_paths(data: dict, base: str | Path = ".") -> dict:
    """A copy of ``data`` (a config as a mapping) with each relative path made absolute from the folder ``base``
    (``~`` expanded): ``data.path``, ``train.init_from`` and the ``data.options`` its source declares paths
    (``register_source(path_options=...)``). A value that is not a path is left to validation.

    :func:`load_config` takes a file's paths from the file's folder and the rest (``--set``, a mapping) from the
    working directory, so a run's config.yaml means the same from any directory (``--resume``, ``kilolayer
    evaluate``, a study's commands)."""
    out = copy.deepcopy(data)
    options = getattr(_source(out), "path_options", ())
    for *sections, key in (("data", "path"), ("train", "init_from"), *(("data", "options", k) for k in options)):
        node = out
        for name in sections:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key]:
            node[key] = os.path.abspath(Path(base).expanduser() / Path(node[key]).expanduser())
    return out


def _yaml_problem(err: yaml.YAMLError) -> str:
    """Where the parser stopped and why, as the end of one line: ``at line 3, column 9: mapping values are not
    allowed here (while scanning a simple key)``."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    context = getattr(err, "context", None)
    return f"{where}: {problem}" + (f" ({' '.join(context.split())})" if context else "")


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p}: a folder, not a config file; give a YAML file in it or a preset name")
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        text = p.read_text()
        data = load_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML{_yaml_problem(err)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{p}: cannot read ({err.__class__.__name__})") from None
    if data is None:  # an empty file is a mistake, not a request for every default
        what = "the file is empty" if not text.strip() else "the file holds only comments"
        raise ConfigError(f"{p}: {what}; expected a mapping of sections (model, objective, data, train)")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of sections (model, objective, data, train)")
    return data


def load_config(source: str | Path | dict | None = None, sets: list[str] | None = None) -> Config:
    """Load a full config from a YAML file, a preset name or a dict, then apply ``--set`` items.

    A file that holds only a model section (or a preset name) gives defaults for the rest. Paths come out
    absolute (:func:`absolute_paths`): a file's relative to its folder, the rest relative to the working directory.
    """
    from kilolayer.presets import PRESETS

    if source is None:
        data: dict = {}
    elif isinstance(source, BaseModel):
        data = source.model_dump()
    elif isinstance(source, dict):
        data = copy.deepcopy(source)
    elif str(source) in PRESETS:
        data = {"model": copy.deepcopy(PRESETS[str(source)])}
    elif _looks_like_a_name(source):
        near = difflib.get_close_matches(str(source), list(PRESETS), n=3)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise ConfigError(f"{source}: neither a preset nor a config file; {hint}`kilolayer presets` lists the presets")
    else:
        data = absolute_paths(read_yaml(source), Path(source).parent)
    data = absolute_paths(apply_sets(data, sets or []))
    return _validate(Config, data, "")


def flatten(data: dict, prefix: str = "") -> dict:
    """A nested dict as dotted keys: ``{"train": {"lr": 1e-3}}`` -> ``{"train.lr": 1e-3}`` (tuples as lists)."""
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def differences(old: dict, new: dict) -> dict:
    """``{"train.lr": [old, new], ...}`` for every dotted key whose value differs between two nested dicts."""
    a, b = flatten(old), flatten(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def config_changes(old: Config | None, new: Config) -> dict:
    """:func:`differences` of two configs (none against no config)."""
    if old is None:
        return {}
    return differences(old.model_dump(mode="json"), new.model_dump(mode="json"))


def dump_yaml(cfg: BaseModel) -> str:
    """``cfg`` as YAML. A :class:`Config`'s ``data`` section leaves out a field (``task``, ``path``) that its
    source does not read (``register_source(reads=...)``) while it holds its default: loading gives it back."""
    data = cfg.model_dump(mode="json")
    if isinstance(cfg, Config):
        reads = getattr(SOURCES.get(cfg.data.name), "data_fields", ())
        fields = DataConfig.model_fields
        data["data"] = {
            k: v for k, v in data["data"].items() if k in ("name", "options") or k in reads or v != fields[k].default
        }
    return to_yaml(data, sort_keys=False)
