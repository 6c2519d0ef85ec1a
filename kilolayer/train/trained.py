"""A trained model ready to use: loaded from a run directory or an export, prompted with text, exported.

An export is a folder that holds what using the model needs and nothing of its training: ``model.safetensors``
(the task's weights: backbone and heads), ``config.yaml`` (the run's resolved config) and ``tokenizer.json``
(with the tokenizer's own files where the data has them; :mod:`kilolayer.data.codec`). It loads without the run
directory or the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kilolayer import rundir
from kilolayer.config import Config, dump_yaml, load_config
from kilolayer.data import load_source
from kilolayer.data.codec import Codec, read_codec
from kilolayer.data.text import codec_for
from kilolayer.errors import ConfigError, InputError
from kilolayer.files import atomic_folder
from kilolayer.objectives import OBJECTIVES, Task, build_task
from kilolayer.objectives.decoding import Decoding
from kilolayer.train.checkpoint import (
    _write_error,
    check_fits,
    load_run_weights,
    load_weights,
    save_weights,
    standing_checkpoint,
)
from kilolayer.train.device import resolve_device

WEIGHTS = "model.safetensors"


def generating_objectives() -> list[str]:
    """The objectives that write text (those with a ``generate`` method)."""
    return sorted(name for name, cls in OBJECTIVES.items() if hasattr(cls, "generate"))


@dataclass
class Trained:
    """A trained task in eval mode with its config and its data's codec (None for a model of images).

    ``task.backbone`` is the Transformer, ``task.objective`` its heads; ``step`` the training step of its weights
    (None for an export); ``path`` where it was loaded from."""

    config: Config
    task: Task
    codec: Codec | None
    path: Path
    step: int | None = None

    @property
    def device(self) -> torch.device:
        return next(self.task.parameters()).device

    def _codec(self) -> Codec:
        if self.codec is None:
            name = self.config.data.name
            if self.config.model.input != "tokens":
                raise ConfigError(f"data.name={name!r}: the model reads images; it has no tokenizer")
            raise ConfigError(
                f"data.name={name!r}: this data has no text vocabulary, so a prompt cannot be read as text; give "
                "token ids in Python: kilolayer.load(RUN).generate_ids([id, ...])"
            )
        return self.codec

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` in the model's vocabulary."""
        return self._codec().encode(text)

    def decode(self, ids) -> str:
        """The text of ``ids`` (up to the first end-of-sequence id)."""
        return self._codec().decode(ids)

    def generate_ids(self, prompt: list[int], decoding: Decoding | None = None, **settings) -> list[int]:
        """The ids the model writes for the ids ``prompt``: a causal LM's continuation, a seq2seq model's output
        (without BOS or EOS). ``settings`` are :class:`~kilolayer.objectives.decoding.Decoding`'s fields."""
        decoding = decoding or Decoding.of(settings)
        objective = self._generating()
        codec = self.codec
        specials = {"eos": codec.eos if codec else None}
        if codec is not None and codec.bos is not None:
            specials["bos"] = codec.bos
        return objective.generate(self.task.backbone, list(prompt), decoding, **specials)

    def generate(self, prompt: str, decoding: Decoding | None = None, **settings) -> str:
        """The text the model writes for ``prompt``. ``settings`` (or ``decoding``): ``max_new_tokens``,
        ``temperature``, ``top_k``, ``top_p``, ``seed`` (a causal LM samples; greedy by default), ``beams``,
        ``length_penalty`` (seq2seq: beam search; greedy by default); see
        :class:`~kilolayer.objectives.decoding.Decoding`."""
        decoding = decoding or Decoding.of(settings)
        self._generating()
        return self.decode(self.generate_ids(self.encode(prompt), decoding))

    def _generating(self):
        objective = self.task.objective
        if not hasattr(objective, "generate"):
            raise ConfigError(
                f"objective.name={self.config.objective.name!r}: {self.path} does not generate text; "
                f"objectives that do: {', '.join(generating_objectives())}"
            )
        return objective

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The vocabulary logits of a generating model: a causal LM's for each position of ``inputs`` (B, T); a
        seq2seq model's for each position of the decoder input ``targets`` (B, T'), given the source ``inputs``."""
        objective = self._generating()
        hidden = self.task.backbone(inputs) if targets is None else self.task.backbone(inputs, targets)
        return objective.head(hidden).float()

    def export(self, out: str | Path) -> Path:
        """Write this model to the folder ``out`` (which must not exist, or be empty) as an export (module
        docstring), checked to load back without its data; returns ``out``."""
        out = Path(out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise InputError(f"--out {out}: exists and is not an empty folder")
        config = self.config.model_copy(deep=True)
        classes = getattr(self.task.objective, "num_classes", None)
        if classes and config.objective.options.get("num_classes") is None:
            # the classes the data gave the head, so that the export builds without its data
            config.objective.options["num_classes"] = classes
        weights = {k: v.detach().cpu().contiguous() for k, v in self.task.state_dict().items()}
        try:
            standalone = build_task(config, None)
        except ConfigError as err:
            raise ConfigError(f"{self.path}: cannot be exported: without its data, {err}") from None
        check_fits(out / WEIGHTS, weights, standalone.state_dict())
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with atomic_folder(out) as tmp:
                save_weights(weights, tmp / WEIGHTS)
                (tmp / rundir.CONFIG).write_text(dump_yaml(config))
                if self.codec is not None:
                    self.codec.save(tmp)
        except OSError as err:
            raise _write_error(out, err) from None
        return out


def load(path: str | Path, device: str = "cpu", checkpoint: str | Path | None = None) -> Trained:
    """The trained model in ``path``: a run directory (its standing checkpoint, or ``checkpoint``) or a folder
    written by :func:`export`; in eval mode on ``device`` (``auto``: cuda where available). A run whose data is
    gone loads from what its directory keeps (see :func:`_without_data`)."""
    device = resolve_device(device, "device")
    path = Path(path)
    if (path / WEIGHTS).is_file() and (path / rundir.CONFIG).is_file():
        config = load_config(path / rundir.CONFIG)
        task = build_task(config, None)  # no data: the export's config holds every size the heads need
        load_weights(path / WEIGHTS, task)
        return Trained(config, task.to(device).eval(), read_codec(path), path)
    if not (path / rundir.CONFIG).is_file():
        raise InputError(f"{path}: neither a kilolayer run directory nor an export (no config.yaml)")
    config = load_config(path / rundir.CONFIG)
    ckpt = standing_checkpoint(path, checkpoint, config.train.patience)
    try:
        source = load_source(config)
    except InputError as missing:  # the data is gone or unreadable: what the run directory keeps is used
        task, codec = _without_data(path, config, missing)
    else:
        task, codec = build_task(config, source), codec_for(config, source)  # heads sized by the data
    step = load_run_weights(path, task, ckpt)
    return Trained(config, task.to(device).eval(), codec, path, step)


def _without_data(path: Path, config: Config, missing: InputError) -> tuple[Task, Codec | None]:
    """The task and codec of the run in ``path`` from what its directory keeps, its data being unreadable
    (``missing``): the config sizes the heads, tokenizer.json is the codec. One line naming the missing file
    where the run needs its data still (a head only the data sizes, a run that keeps no tokenizer.json)."""
    try:
        task = build_task(config, None)
    except ConfigError as err:
        raise InputError(f"{missing}; {path} needs the run's data to size its heads ({err})") from None
    codec = read_codec(path)
    if codec is None and config.model.input == "tokens":
        raise InputError(f"{missing}; {path} needs the run's data for its vocabulary (it keeps no tokenizer.json)")
    return task, codec


def export(path: str | Path, out: str | Path, checkpoint: str | Path | None = None) -> Path:
    """:meth:`Trained.export` of the trained model in ``path`` (a run directory, its standing checkpoint or
    ``checkpoint``; or an export)."""
    return load(path, checkpoint=checkpoint).export(out)
