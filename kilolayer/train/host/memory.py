"""Memory a training run needs, estimated from its config before anything is allocated.

:func:`estimate_memory` gives bytes per training process:

* ``parameters``: 4 bytes (fp32 master weights) per parameter. The backbone's
  count is exact, from :func:`kilolayer.nn.budget.count_parameters` (what
  ``kilolayer describe`` prints); the objective's heads and towers are exact
  too: they are built on PyTorch's ``meta`` device, which allocates nothing.
* ``gradients``: 4 bytes per trainable parameter (none for a frozen backbone).
* ``optimizer``: AdamW's ``exp_avg`` and ``exp_avg_sq``, 8 bytes per trainable
  parameter, fused or not; ``optimizer_temp`` is the one parameter-sized
  temporary of the multi-tensor (foreach) step, 0 for ``train.fused_optimizer``.
* ``activations``: what autograd keeps for one micro-batch of
  ``train.batch_size / train.accumulate / processes`` samples at the model's
  full length (``model.max_len`` tokens, or every patch + CLS), counted tensor
  by tensor for the layers as written (fused QKV, SDPA, GELU FFN): per token and
  self-attention sublayer, the input of each LayerNorm, the QKV input, Q/K/V and
  the attention output; per FFN, its input, the hidden pre-activation and
  activation; per cross-attention, Q, its input and output, plus K/V per source
  token. bf16 autocast keeps matmul activations in 2 bytes and LayerNorm inputs
  in 4. The attention itself is O(T) (SDPA's flash/efficient kernels keep only
  a log-sum-exp per head), except where it runs as matrix products: on CPU
  under bf16 with ``model.cpu_attention: auto`` up to
  :data:`~kilolayer.nn.attention.MATMUL_MAX_KEYS` keys (Q, K, V in 2 bytes, the
  fp32 probabilities and their bf16 copy: 6 bytes per head, query and key), and
  with dropout on CPU, where SDPA takes its math path and keeps three fp32
  T x S matrices per head; longer sequences under bf16 on CPU attend in fp32
  (dropout there keeps an fp32 noise tensor; on CUDA a bool mask). With
  ``model.checkpoint_activations`` each layer keeps only its input, and one
  layer is recomputed at a time (likewise for a contrastive text tower whose
  ``objective.options.text_model`` sets it; :mod:`kilolayer.train.parallelize`).
  A vocabulary head keeps logits, log-probabilities and their gradient: 12
  bytes (14 in bf16) per token and vocabulary entry.
  bf16 also keeps a 2-byte copy of every matmul weight (autocast's cache).
* ``total``: the peak of a steady-state step: parameters + optimizer + the larger
  of activations (the forward's end) and gradients + the optimizer's temporary
  (the step); with ``train.accumulate > 1`` gradients live through every
  micro-batch and are added to both. DDP adds its gradient buckets (one more
  copy of the gradients); FSDP divides parameters, gradients and optimizer
  state by the number of processes.

``tests/test_memory_check.py`` checks the estimate against the peak resident
memory of real training steps. On the CPU, glibc's allocator keeps freed blocks,
so resident memory runs above the live tensors: leave about a third more than
the estimate when it is close to the limit.

:func:`check_memory` compares the estimate with what the device has free and
refuses, in one line, a config that cannot fit (``train.memory_check: false``
overrides).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from kilolayer.config import Config, ModelConfig
from kilolayer.data.base import Source
from kilolayer.errors import ConfigError
from kilolayer.nn.attention import MATMUL_MAX_KEYS
from kilolayer.nn.budget import count_parameters
from kilolayer.nn.residual import Depth, Site, make_scheme

GIB = 2**30


@dataclass(frozen=True)
class _Sublayer:
    """What one residual sublayer keeps for backward, as far as its size depends on its structure."""

    kind: str  # self_attn | cross_attn | ffn
    width: int
    ffn: int
    heads: int
    norms: int  # LayerNorms around the branch (pre, out, post)
    inner_norm: bool
    head_scale: bool
    gains: int  # elementwise products on the branch output (LayerScale's branch scale, ReZero's scalar)
    dropout: float


def _config_layers(cfg: ModelConfig, side: str, n: int, cross: bool) -> Counter:
    """The layers of one side of ``cfg``, from the scheme alone (no modules built): how many layers have
    each distinct tuple of sublayers (a 100,000-layer stack is a handful of entries)."""
    scheme = make_scheme(
        cfg.scheme,
        Depth(cfg.arch, cfg.encoder_depth, cfg.decoder_depth),
        layerscale_init=cfg.layerscale_init,
        ds_init_variant=cfg.ds_init_variant,
    )
    kinds = ("self_attn", "cross_attn", "ffn") if cross else ("self_attn", "ffn")
    gains = int(scheme.branch_scale is not None)  # per channel (LayerScale) or one per layer (ReZero)
    outer = int(scheme.pre_norm) + int(scheme.post_norm)
    flags: Counter = Counter()  # (norms, inner norm, head scale) per sublayer -> layers
    for i in range(n):
        key = []
        for kind in kinds:
            site = Site(side, i, kind)
            inner = scheme.ffn_inner_norm(site) if kind == "ffn" else scheme.attn_inner_norm(site)
            scale = kind != "ffn" and bool(scheme.head_scale(site))
            key.append((outer + int(scheme.out_norm(site)), bool(inner), scale))
        flags[tuple(key)] += 1
    return Counter(
        {
            tuple(
                _Sublayer(kind, cfg.width, cfg.ffn, cfg.heads, norms, inner, scale, gains, cfg.dropout)
                for kind, (norms, inner, scale) in zip(kinds, key)
            ): count
            for key, count in flags.items()
        }
    )


def _module_layers(stack) -> Counter:
    """The same description read off a built (meta) :class:`~kilolayer.nn.transformer.Stack`."""
    layers: Counter = Counter()
    for layer in stack.layers:
        out = []
        for res in layer.sublayers():
            branch, kind = res.branch, res.site.kind
            width = branch.fc1.in_features if kind == "ffn" else branch.width
            out.append(
                _Sublayer(
                    kind,
                    width,
                    branch.fc1.out_features if kind == "ffn" else 0,
                    0 if kind == "ffn" else branch.heads,
                    # absent parts may be None or nn.Identity
                    sum(isinstance(m, torch.nn.LayerNorm) for m in (res.pre_norm, res.out_norm, res.post_norm)),
                    branch.inner_norm is not None,
                    getattr(branch, "head_scale", None) is not None,
                    _branch_scales(res) + int(layer.resweight is not None),
                    getattr(res.dropout, "p", 0.0),
                )
            )
        layers[tuple(out)] += 1
    return layers


def _branch_scales(res) -> int:
    """Learned multipliers a Residual applies to its branch output (LayerScale): its parameters outside the
    branch, the norms and the shortcut."""
    skip = ("branch.", "pre_norm.", "out_norm.", "post_norm.", "shortcut")
    return sum(1 for name, _ in res.named_parameters() if not name.startswith(skip))


@dataclass(frozen=True)
class _Precision:
    matmul: int  # bytes of a matmul input/output element
    cpu: bool
    cpu_attention: str  # model.cpu_attention

    def attention(self, keys: int) -> tuple[int, bool]:
        """(bytes of Q, K, V and the attention output as attended, whether attention runs as matrix products)
        for ``keys`` keys (:class:`kilolayer.nn.attention.Attention`)."""
        if self.matmul == 4 or not self.cpu or self.cpu_attention == "sdpa":
            return self.matmul, False
        if self.cpu_attention == "auto" and keys <= MATMUL_MAX_KEYS:
            return self.matmul, True
        return 4, False

    @property
    def dropout_mask(self) -> int:
        """Bytes per element of what dropout keeps: CPU multiplies by an fp32 noise tensor, CUDA a bool mask."""
        return 4 if self.cpu else 1


def _sublayer_bytes(s: _Sublayer, p: _Precision, batch: int, length: int, source: int) -> int:
    """Bytes one sublayer keeps for ``batch`` sequences of ``length`` query tokens (``source`` key tokens)."""
    d, f, h = s.width, s.ffn, s.heads
    # a LayerNorm on the residual stream keeps its fp32 input; y * scale keeps the branch output y
    per_token = 4 * d * s.norms + p.matmul * d * s.gains
    per_source = 0
    if s.kind == "ffn":
        per_token += p.matmul * (d + 2 * f) + (p.matmul * f if s.inner_norm else 0)
        per_token += p.dropout_mask * (f + d) if s.dropout else 0
    else:
        keys = length if s.kind == "self_attn" else source
        attended, products = p.attention(keys)
        cast_back = p.matmul * d if attended != p.matmul else 0  # attention output cast back for out-proj
        # the Q (or QKV) projection's input, Q, the attention output, a log-sum-exp per head (SDPA's)
        per_token += p.matmul * d + 2 * attended * d + cast_back + (0 if products else 4 * h)
        if s.kind == "self_attn":
            per_token += 2 * attended * d  # K, V of the same tokens
        else:
            per_source += 2 * attended * d + (p.matmul * d if p.matmul != 4 else 0)
        per_token += (p.matmul * d if s.inner_norm else 0) + (p.matmul * d if s.head_scale else 0)
        per_token += p.dropout_mask * d if s.dropout else 0
    total = (per_token * length + per_source * source) * batch
    if s.kind != "ffn" and products:
        # fp32 probabilities (softmax's output) and their bf16 copy; with dropout its fp32 noise too
        total += (10 if s.dropout else 6) * batch * h * length * keys
    elif s.kind != "ffn" and s.dropout and p.cpu:
        # SDPA's math path keeps the probabilities, the dropout noise and the dropped probabilities
        total += 12 * batch * h * length * keys
    return total


def _stack_bytes(layers: Counter, p: _Precision, batch: int, length: int, source: int, checkpoint: bool) -> int:
    """Activations kept by a stack of ``layers`` (see :func:`_config_layers`) for ``batch`` sequences of
    ``length`` tokens attending to ``source`` tokens."""
    if not layers:
        return 0
    per_layer = {layer: sum(_sublayer_bytes(s, p, batch, length, source) for s in layer) for layer in layers}
    if not checkpoint:
        return sum(per_layer[layer] * n for layer, n in layers.items())
    # each layer keeps its input (the residual stream is fp32); one layer at a time is recomputed
    width = next(iter(layers))[0].width
    return sum(layers.values()) * 4 * width * batch * length + max(per_layer.values())


def _objective_on_meta(config: Config, source: Source | None):
    """The objective's modules, built for ``source`` on the meta device: exact sizes, nothing allocated."""
    from kilolayer.objectives import build_objective

    opts = config.objective.options
    if source is None and config.objective.name == "classification" and not opts.get("num_classes"):
        # only the data knows the classes: without it, 2 (the head is width x classes, small beside the backbone)
        objective = config.objective.model_copy(update={"options": {**opts, "num_classes": 2}})
        config = config.model_copy(update={"objective": objective})
    with torch.device("meta"):
        return build_objective(config, SimpleNamespace(config=config.model), source)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def estimate_memory(
    config: Config, device: str | torch.device = "cpu", world: int | None = None, source: Source | None = None
) -> dict:
    """Bytes one training process of ``config`` needs on ``device`` (see the module docstring).

    Returns ``parameters``, ``gradients``, ``optimizer``, ``optimizer_temp``, ``activations`` and ``total``
    (bytes), and ``n_parameters`` / ``n_trainable`` (counts). ``world`` defaults to torchrun's WORLD_SIZE.
    ``source``: the run's data source, which sizes the heads exactly (e.g. its classes); without it, nothing is
    loaded and a classifier without ``objective.options.num_classes`` is counted with 2 classes. The trainer
    checks memory this way, before the data loads, because a source learns its classes only by loading (an
    image folder's listing, a dataset's metadata); the difference is negligible, as each class adds
    ``width + 1`` head parameters and one logit per sample (1,000 classes at width 1,024: about 16 MB of
    weights, gradients and AdamW state).
    """
    from kilolayer.nn.transformer import Backbone, Stack

    m, tc = config.model, config.train
    if tc.precision == "auto":  # decided at the run's start, after this check: the larger of the two
        at = [config.model_copy(update={"train": tc.model_copy(update={"precision": p})}) for p in ("fp32", "bf16")]
        return max((estimate_memory(c, device, world, source) for c in at), key=lambda e: e["total"])
    world = world or _world()
    device = torch.device(device)
    cpu = device.type != "cuda"
    objective = _objective_on_meta(config, source)
    n_backbone = count_parameters(m)
    n_objective = sum(p.numel() for p in objective.parameters())
    n_params = n_backbone + n_objective
    n_trainable = n_objective + (0 if tc.freeze_backbone else n_backbone)

    bf16 = tc.precision == "bf16"
    prec = _Precision(matmul=2 if bf16 else 4, cpu=cpu, cpu_attention=m.cpu_attention)
    batch = max(1, tc.batch_size // tc.accumulate // world)
    ckpt = m.checkpoint_activations
    # the backbone's sequences, as long as the objective shows it (MAE's encoder: the visible patches + CLS)
    length = objective.backbone_length(m.seq_len)
    acts = 0
    if m.arch == "encoder":
        acts += _stack_bytes((_config_layers(m, "encoder", m.layers, False)), prec, batch, length, length, ckpt)
    elif m.arch == "decoder":
        acts += _stack_bytes((_config_layers(m, "decoder", m.layers, False)), prec, batch, length, length, ckpt)
    else:
        acts += _stack_bytes((_config_layers(m, "encoder", m.layers, False)), prec, batch, length, length, ckpt)
        acts += _stack_bytes((_config_layers(m, "decoder", m.decoder_layers, True)), prec, batch, length, length, ckpt)
        acts += 4 * m.width * batch * length  # the encoder output, read by every decoder layer
    if m.input == "patches":
        acts += 4 * m.channels * m.patch_size**2 * batch * m.num_patches  # the patch projection's input
    acts += 4 * m.width * batch * length  # the final hidden states, the heads' input
    # the objective's own stacks: a text tower at its own length, checkpointed when its own model section
    # asks (as kilolayer.train.parallelize does); MAE's decoder over every patch + CLS, never checkpointed
    towers = {id(s) for mod in objective.modules() if isinstance(mod, Backbone) for s in mod.stacks()}
    for mod in objective.modules():
        if isinstance(mod, Backbone):
            for stack in mod.stacks():
                L = mod.config.seq_len
                acts += _stack_bytes(_module_layers(stack), prec, batch, L, L, mod.config.checkpoint_activations)
        elif isinstance(mod, Stack) and id(mod) not in towers:
            acts += _stack_bytes(_module_layers(mod), prec, batch, m.seq_len, m.seq_len, False)
    # vocabulary heads: logits over every token (MLM: over the masked share)
    share = objective.vocab_share
    for mod in objective.modules():
        if isinstance(mod, torch.nn.Linear) and mod.out_features == m.vocab_size and m.input == "tokens":
            acts += int((14 if bf16 else 12) * m.vocab_size * batch * length * share)
    if bf16:
        acts += 2 * n_trainable  # autocast's bf16 copies of the weights, kept for backward

    params = 4 * n_params
    grads = 4 * n_trainable
    optim = 8 * n_trainable
    temp = 0 if tc.fused_optimizer else 4 * n_trainable
    if world > 1 and tc.parallel == "fsdp":
        params, grads, optim, temp = (x // world for x in (params, grads, optim, temp))
    elif world > 1:
        grads *= 2  # DDP's gradient buckets
    accumulating = tc.accumulate > 1  # gradients then live through the micro-batches' forward passes
    total = params + optim + (grads + max(acts, temp) if accumulating else max(acts, grads + temp))
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": optim,
        "optimizer_temp": temp,
        "activations": acts,
        "total": total,
        "n_parameters": n_params,
        "n_trainable": n_trainable,
        "accumulating": accumulating,
    }


def format_estimate(est: dict) -> str:
    """``total`` and how it is made up, in GiB: "12.3 GiB at peak (params 1.0 + optimizer 2.0 + ...)"."""
    g = {k: _gib(est[k]) for k in ("total", "parameters", "optimizer", "activations", "gradients", "optimizer_temp")}
    if est["accumulating"]:
        rest = f"grads {g['gradients']} + max(activations {g['activations']}, AdamW temporaries {g['optimizer_temp']})"
    else:
        rest = f"max(activations {g['activations']}, grads {g['gradients']} + AdamW temporaries {g['optimizer_temp']})"
    return f"{g['total']} GiB at peak (params {g['parameters']} + optimizer {g['optimizer']} + {rest})"


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """What this process's cgroup (v2, else v1) still allows, if it sets a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - usage)
    return None


def available_memory(device: str | torch.device) -> int | None:
    """Bytes free for a new allocation on ``device``: the GPU's free memory, or for the CPU the smaller of
    /proc/meminfo's MemAvailable and the cgroup's remaining limit. None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    known = [x for x in (_meminfo_available(), _cgroup_available()) if x is not None]
    return min(known) if known else None


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _target(device: str | torch.device) -> torch.device:
    """``device`` as the trainer will use it: ``auto`` resolved, a bare ``cuda`` as this process's GPU."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # as torchrun's processes do
    return device


def check_memory(config: Config, device: str | torch.device, source: Source | None = None) -> dict | None:
    """Refuse ``config`` (one-line :class:`ConfigError`) if its estimated peak exceeds the memory ``device``
    has free; return the estimate with ``available`` (bytes, None if unknown). On the CPU the processes
    torchrun starts on this machine (LOCAL_WORLD_SIZE) share the memory. With ``train.memory_check: false``
    nothing is estimated or checked and None is returned. ``source``: as for :func:`estimate_memory`."""
    if not config.train.memory_check:
        return None
    device = _target(device)
    est = estimate_memory(config, device, source=source)
    est["available"] = available_memory(device)
    if est["available"] is None:
        return est
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type != "cuda" else 1
    need = est["total"] * local
    if need > est["available"]:
        who = f"{local} processes x " if local > 1 else ""
        raise ConfigError(
            f"model: needs about {who}{format_estimate(est)} but {_gib(est['available'])} GiB is available on "
            f"{device.type}; use a smaller model or batch, or set train.memory_check=false"
        )
    return est
