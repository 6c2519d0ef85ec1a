"""Any residual scheme, DeepNorm included, in your own modules: the scheme, the residual around a sublayer, and
the init of the sublayer's weights.

kilolayer's own layers (``kilolayer/nn/layers.py``) are made of the same pieces: a :class:`Residual` per
attention or FFN sublayer, and Xavier with :meth:`Scheme.init_gain` on each of its Q, K, V, O, W1 and W2 weights. So a
model assembled from a user's attention and FFN modules with :func:`residual` and :func:`init_branches`
computes what :func:`~kilolayer.nn.transformer.build_model`'s does on the same weights, and starts from the
same initial statistics; the formulas stay in the scheme classes (DeepNorm's in ``kilolayer/nn/deepnorm.py``).

Only weights inside a residual branch are ever initialised, so embeddings and output heads keep their own init.
"""

from __future__ import annotations

from collections.abc import Iterator
from fnmatch import fnmatchcase

import torch
from torch import nn

from kilolayer.errors import ConfigError
from kilolayer.nn.deepnorm import deepnorm_constants
from kilolayer.nn.residual import SCHEME_OPTIONS, SCHEMES, Depth, Residual, Scheme, Site, make_scheme, xavier_

KINDS = ("self_attn", "cross_attn", "ffn")
ATTENTION_ROLES = ("q", "k", "v", "o")
FFN_ROLES = ("w1", "w2")
FUSED = {"qkv": ("q", "k", "v"), "kv": ("k", "v")}  # rows stacked in this order

Target = str | nn.Module | nn.Parameter  # what names a weight: a name pattern, an nn.Linear or a 2-D parameter


def residual_scheme(name: str, arch: str, encoder_layers: int = 0, decoder_layers: int = 0, **options) -> Scheme:
    """The residual scheme ``name`` (``"deepnorm"``, ``"post_ln"``, ...; ``sorted(kilolayer.SCHEMES)``) set for
    a model of ``arch`` (``"encoder"``, ``"decoder"`` or ``"encoder_decoder"``) with that many layers per side.

    ``options`` are the scheme options of the ``model`` config (``layerscale_init``, ``ds_init_variant``,
    ``admin_omega``, ``branchnorm_steps``).
    """
    if name not in SCHEMES:
        raise ConfigError(f"name={name!r}: unknown residual scheme; allowed: {', '.join(sorted(SCHEMES))}")
    for field, value in (("encoder_layers", encoder_layers), ("decoder_layers", decoder_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{field}={value!r}: expected a layer count, an int of 0 or more")
    deepnorm_constants(arch, encoder_layers, decoder_layers)  # checks arch and the layer counts it needs
    if arch == "encoder" and decoder_layers:
        raise ConfigError(f"decoder_layers={decoder_layers}: an encoder has no decoder layers")
    if arch == "decoder" and encoder_layers:
        raise ConfigError(f"encoder_layers={encoder_layers}: a decoder has no encoder layers")
    unknown = sorted(set(options) - set(SCHEME_OPTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a scheme option; allowed: {', '.join(SCHEME_OPTIONS)}")
    return make_scheme(name, Depth(arch, encoder_layers, decoder_layers), **options)


def residual(
    branch: nn.Module,
    width: int,
    scheme: Scheme,
    *,
    kind: str,
    layer: int,
    side: str | None = None,
    eps: float = 1e-5,
    dropout: float = 0.0,
) -> Residual:
    """``branch`` (your attention or FFN module) inside the residual sublayer that ``scheme`` puts at ``kind``
    (``"self_attn"``, ``"cross_attn"`` or ``"ffn"``) of layer ``layer`` (0-based) on ``side`` (``"encoder"`` or
    ``"decoder"``; implied unless the scheme is for an encoder-decoder).

    For DeepNorm the result computes ``LN(alpha * x + branch(x))``. Keyword inputs are passed on to the branch
    (``res(x, memory=m)``). A pre-norm scheme also wants ``scheme.final_part(side, width, eps)`` after the
    last layer. Schemes that place parts inside the branch or across layers (Sub-LN, NormFormer, R-Fixup,
    ReZero, DLCL, BranchNorm, profiled Admin) are refused with what they need: build those with
    ``build_model``. A branch that states its width (a ``width``, ``embed_dim``, ``d_model``, ``hidden_size`` or
    ``in_features`` attribute) is checked against ``width`` here; any branch, on its first input.
    """
    if not isinstance(scheme, Scheme):
        raise ConfigError(f"scheme: expected a scheme from kilolayer.residual_scheme(...), got {type(scheme).__name__}")
    if not isinstance(branch, nn.Module):
        raise ConfigError(f"branch: expected an nn.Module (your attention or FFN), got {type(branch).__name__}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ConfigError(f"width={width!r}: expected a positive int, the model width")
    stated = _stated_width(branch)
    if stated is not None and stated[1] != width:
        raise ConfigError(
            f"width={width}: the branch ({type(branch).__name__}) is {stated[1]} wide ({stated[0]}={stated[1]})"
        )
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r}: expected one of {', '.join(KINDS)}")
    depth = scheme.depth
    if side is None:
        if depth.arch == "encoder_decoder":
            raise ConfigError("side: expected 'encoder' or 'decoder' for an encoder_decoder scheme")
        side = depth.arch
    if side not in depth.sides():
        raise ConfigError(f"side={side!r}: expected one of {', '.join(depth.sides())} for this {depth.arch} scheme")
    if kind == "cross_attn" and (depth.arch != "encoder_decoder" or side != "decoder"):
        raise ConfigError("kind='cross_attn': only the decoder of an encoder_decoder scheme has cross-attention")
    n = depth.layers(side)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise ConfigError(f"layer={layer!r}: expected an int in 0..{n - 1} for the {n} {side} layers of the scheme")
    site = Site(side, layer, kind)
    needs = scheme.outside_residual(site)
    if needs:
        raise ConfigError(
            f"scheme={scheme.name!r} at {kind} needs {'; '.join(needs)}, which residual() cannot add to your "
            "module; build this scheme with kilolayer.build_model"
        )
    res = Residual(branch, width, site, scheme, eps, dropout)
    res._width_check = res.register_forward_pre_hook(_check_input_width, with_kwargs=True)
    return res


WIDTH_ATTRIBUTES = ("width", "embed_dim", "d_model", "hidden_size", "in_features")


def _stated_width(branch: nn.Module) -> tuple[str, int] | None:
    """(attribute, value) of the first width attribute ``branch`` has, if any."""
    for name in WIDTH_ATTRIBUTES:
        value = getattr(branch, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def _check_input_width(res: Residual, args: tuple, kwargs: dict) -> None:
    """Before the first forward of a user's residual: its input is ``width`` wide, or one line saying so (a
    mismatch would otherwise surface deep in a LayerNorm or a matmul); then the check removes itself."""
    x = args[0] if args else kwargs.get("x")
    if isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] != res.width:
        raise ConfigError(
            f"width={res.width}: the {res.site.kind} residual of layer {res.site.layer} got an input "
            f"{x.shape[-1]} wide (shape {tuple(x.shape)}); give residual() the model width of its input"
        )
    res._width_check.remove()


@torch.no_grad()
def init_branches(
    module: nn.Module,
    scheme: Scheme,
    *,
    q: Target | list[Target] | None = None,
    k: Target | list[Target] | None = None,
    v: Target | list[Target] | None = None,
    qkv: Target | list[Target] | None = None,
    kv: Target | list[Target] | None = None,
    o: Target | list[Target] | None = None,
    w1: Target | list[Target] | None = None,
    w2: Target | list[Target] | None = None,
    transposed: bool = False,
) -> list[tuple[str, str, float]]:
    """Initialise the weights of every residual branch in ``module`` (the sublayers made by :func:`residual`) as
    ``scheme`` does: Xavier with the scheme's gain for each weight's role at the branch's site, biases zero.
    For DeepNorm: gain beta on V, O, W1, W2 and 1 on Q, K.

    Each role names the ``nn.Linear`` layers (or 2-D weight parameters, laid out ``(out, in)``) that play it,
    as a name pattern relative to the branch (``fnmatch``: ``"v_proj"``, ``"mlp.*"``), a module or parameter
    object, or a list of these. ``qkv`` is a fused ``[Q; K; V]`` projection and ``kv`` a fused ``[K; V]`` one:
    each third (half) of its rows gets its own role's init. Attention roles are looked up in attention branches
    only, ``w1``/``w2`` in FFN branches only. Every attention branch must end up with Q, K, V and O, every FFN
    branch with W1 and W2, and every 2-D weight of a branch with a role (a gated FFN's third matrix too:
    ``w1=["w1", "w3"]``), so that none keeps PyTorch's default init unnoticed; biases and norm weights are
    1-D and left to the rule above. Nothing outside the branches (embeddings, heads) is touched.

    ``transposed=True`` reads every given weight as laid out ``(in, out)``, as GPT-2's ``Conv1D`` stores it
    (``c_attn.weight`` of shape ``(d, 3d)``): a fused weight then splits along its columns. A fused weight of
    shape ``(width, 3 * width)`` (``(width, 2 * width)`` for ``kv``) given without it is refused, since split by
    rows it would mix Q, K and V.

    Returns ``(parameter name, role, gain)`` per initialised weight, fused slices as ``name[start:stop]``.
    """
    if not isinstance(module, nn.Module):
        raise ConfigError(f"module: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(scheme, Scheme):
        raise ConfigError(f"scheme: expected a scheme from kilolayer.residual_scheme(...), got {type(scheme).__name__}")
    given = {"q": q, "k": k, "v": v, "qkv": qkv, "kv": kv, "o": o, "w1": w1, "w2": w2}
    roles = {role: value if isinstance(value, list) else [value] for role, value in given.items() if value is not None}
    residuals = [(name, m) for name, m in module.named_modules() if isinstance(m, Residual)]
    if not residuals:
        raise ConfigError("module: contains no residual sublayer; wrap each attention and FFN in kilolayer.residual")

    plan: list[tuple[str, Site, str, torch.Tensor, torch.Tensor | None]] = []
    hits = {(role, i): 0 for role, targets in roles.items() for i in range(len(targets))}
    uncovered = ""  # the first branch left without a weight for one of its roles
    unroled = ""  # the first 2-D weight of a branch that no role names
    for path, res in residuals:
        prefix = f"{path}.branch." if path else "branch."
        attention = res.site.kind != "ffn"
        weights = dict(_weights(res.branch))
        owner: dict[str, str] = {}  # weight name -> the role that claimed it
        covered: set[str] = set()
        for role, targets in roles.items():
            if (role in FFN_ROLES) == attention:
                continue
            for i, target in enumerate(targets):
                for name in _matches(role, target, weights):
                    hits[role, i] += 1
                    if name in owner:
                        raise ConfigError(f"{role}: {prefix}{weights[name][2]} is already given as {owner[name]}")
                    owner[name] = role
                    weight, bias, param = weights[name]
                    for part, w, b, rows in _split(role, target, weight, bias, res.width, transposed):
                        plan.append((f"{prefix}{param}{rows}", res.site, part, w, b))
                        covered.add(part)
        hint = "q=, k=, v= or qkv=, kv=, o=" if attention else "w1=, w2="
        missing = [r for r in (ATTENTION_ROLES if attention else FFN_ROLES) if r not in covered]
        if missing and not uncovered:
            uncovered = (
                f"{missing[0]}: the {res.site.kind} branch of {path or 'module'} has no weight given for it ({hint})"
            )
        idle = [name for name in weights if name not in owner]
        if idle and not unroled:
            param = weights[idle[0]][2]
            given = [(r, t) for r, ts in roles.items() for t in ts if (r in FFN_ROLES) != attention]
            role, pattern = next(
                ((r, t) for r, t in given if isinstance(t, str)), ("w1" if not attention else "v", "...")
            )
            example = f"{role}=[{pattern!r}, {idle[0]!r}]"
            unroled = (
                f"{prefix}{param}: a 2-D weight of the {res.site.kind} branch of {path or 'module'} that no role "
                f"names, so it would keep PyTorch's default init; give it one of {hint} (e.g. {example})"
            )
    # a pattern that matches nothing explains a branch left without a weight, so it is reported first
    for (role, i), count in hits.items():
        if not count:
            kinds = "FFN" if role in FFN_ROLES else "attention"
            target = roles[role][i]
            shown = repr(target) if isinstance(target, str) else f"a {type(target).__name__}"
            raise ConfigError(
                f"{role}={shown}: matches no nn.Linear or 2-D weight in any {kinds} residual branch of module"
            )
    if uncovered:
        raise ConfigError(uncovered)
    if unroled:
        raise ConfigError(unroled)
    done = []
    for name, site, part, weight, bias in plan:  # as kilolayer's own layers do (Layer.reset_parameters)
        gain = scheme.init_gain(site, part)
        xavier_(weight, gain, scheme.init_dist)
        if bias is not None:
            bias.zero_()
        done.append((name, part, gain))
    return done


def _weights(branch: nn.Module) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor | None, str]]]:
    """(name, (weight, bias, the weight's parameter name)) of each nn.Linear in ``branch`` and each 2-D parameter
    outside them."""
    linear_params = set()
    for name, m in branch.named_modules():
        if isinstance(m, nn.Linear):
            linear_params.update(id(p) for p in m.parameters(recurse=False))
            yield name, (m.weight, m.bias, f"{name}.weight" if name else "weight")
    for name, p in branch.named_parameters():
        if p.dim() == 2 and id(p) not in linear_params:
            yield name, (p, None, name)


def _matches(role: str, target: Target, weights: dict) -> list[str]:
    """Names in ``weights`` that ``target`` (a name pattern, a Linear or a weight parameter) picks."""
    if isinstance(target, str):
        return [name for name in weights if fnmatchcase(name, target)]
    if isinstance(target, nn.Parameter):
        return [name for name, (w, *_) in weights.items() if w is target]
    if isinstance(target, nn.Linear):
        return [name for name, (w, *_) in weights.items() if w is target.weight]
    raise ConfigError(
        f"{role}: expected a name pattern, an nn.Linear or a 2-D weight parameter, got {type(target).__name__}"
    )


def _split(role: str, target: Target, weight: torch.Tensor, bias: torch.Tensor | None, width: int, transposed: bool):
    """(role of the part, weight rows, bias rows, rows label) for each part of ``weight`` (laid out ``(out, in)``,
    or ``(in, out)`` when ``transposed``): its fused slices, as views that the init writes through."""
    shown = repr(target) if isinstance(target, str) else f"a {type(target).__name__}"
    if transposed:
        weight = weight.T
    parts = FUSED.get(role, (role,))
    if len(parts) == 1:
        yield role, weight, bias, ""
        return
    rows, cols = weight.shape
    fused = "/".join(p.upper() for p in parts)
    if rows == width and cols == len(parts) * width:
        if transposed:
            raise ConfigError(
                f"{role}={shown}: a fused {fused} weight of shape {tuple(weight.T.shape)} is laid out (out, in); "
                "leave out transposed=True for it"
            )
        raise ConfigError(
            f"{role}={shown}: a fused {fused} weight of shape {tuple(weight.shape)} is laid out (in, out), as "
            f"GPT-2's Conv1D stores it; pass transposed=True to init_branches to split it by columns"
        )
    if rows % len(parts):
        raise ConfigError(
            f"{role}={shown}: a fused {fused} weight needs a row count divisible by "
            f"{len(parts)}, got shape {tuple(weight.shape)}"
        )
    n = rows // len(parts)
    axis = "[:, {}:{}]" if transposed else "[{}:{}]"
    for i, part in enumerate(parts):
        s = slice(i * n, (i + 1) * n)
        yield part, weight[s], None if bias is None else bias[s], axis.format(s.start, s.stop)
