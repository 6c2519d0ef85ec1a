"""``diagnose(run_dir)``: why a run stalled, blew up or trained, each line with its evidence and a fix.

What is read or measured (and where it comes from):

* status.json (status, step, reason) and metrics.jsonl (losses; the ``diagnostics`` lines
  ``train.diagnostics_every`` logs);
* step 1 is replayed in memory from the seeds (``kilolayer.doctor.measure.replay``: the run's own
  initialisation and first batch), which gives the first update, gradients and LayerNorm inputs for a
  run trained without diagnostics, and F(x, theta_0) for the measurements below;
* the same step of a DeepNorm model of the same shape, seed and learning rate: the empirical reference
  for the first update;
* the newest intact checkpoint: the total update ||F(x, theta_T) - F(x, theta_0)||, LayerNorm inputs and
  per-layer gradients at the end, and (if RUN/analysis/smoothness/smoothness.json is absent) token
  similarity per layer through the stack's observer (one layer's activations at a time);
* the chance level of the run's evaluation data (``kilolayer.analysis.chance``).

Nothing is written into the run directory.

The rules (each a threshold on one measurement; every number is printed with the line):

* vanishing bottom gradients: per side, the first layer's gradient norm below ``GRAD_RATIO`` x the
  last layer's, at any measured step;
* large first update: the step-1 update at least ``UPDATE_RATIO`` x the DeepNorm reference's, in a model
  deep enough for DeepNet's effects of depth (:func:`kilolayer.doctor.theory.deep_enough`);
* LayerNorm inputs growing with layer: the last layer's mean LayerNorm input (residual-path norms only)
  at least ``LN_GROWTH`` x the first layer's, on a side (in a Pre-LN-family model, only a deep one);
* over-smoothing: last-layer token cosine similarity at least ``COSINE``, in a model deep enough for
  depth to be the cause and that learned something (a model that learned nothing has alike tokens for want
  of learning);
* never below chance: the best evaluation loss at or above the chance level; otherwise, a final
  evaluation loss above ``LEARNED_NOTHING`` x chance is "learned nothing" (the study report's rule);
* barely moved: the total update at the last checkpoint below ``BARELY_MOVED`` x the output's size.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kilolayer.analysis.chance import LEARNED_NOTHING, learned_something
from kilolayer.analysis.stability import read_diagnostics
from kilolayer.config import Config, load_config
from kilolayer.doctor.theory import DEEP_LAYERS, deep_enough, shape_name, update_coefficient
from kilolayer.errors import InputError, KilolayerError
from kilolayer.record import RunRecord
from kilolayer.rundir import CONFIG, METRICS, logged_number, read_metrics, read_status

GRAD_RATIO = 0.1
UPDATE_RATIO = 10.0
LN_GROWTH = 3.0
COSINE = 0.9
BARELY_MOVED = 0.05

POST_LN_FORM = ("post_ln", "post_ln_init", "ds_init", "admin")  # x <- LN(x + F(x)), a shortcut not scaled up
LAYER_NORM = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\..*(pre_norm|post_norm)$")


@dataclass
class Problem:
    """A problem a diagnosis found, one line of it: ``code`` (stable name), ``text`` (with its evidence
    number), the ``suggestion`` tied to that number, and the numbers themselves."""

    code: str
    text: str
    suggestion: str = ""
    evidence: dict = field(default_factory=dict)


@dataclass
class Measurements:
    """Every number the rules read, measured once per run. The per-side lists and the dicts are the evidence a
    problem quotes; each says where its number came from (``source``: logged, replayed or checkpoint)."""

    status: str | None = None  # status.json's
    has_checkpoint: bool = False
    output_norm: float | None = None  # ||F(x, theta_0)|| of the replayed first step
    grad_ratio: dict[str, list[dict]] = field(default_factory=dict)  # side -> [{step, ratio, source}]: bottom/top
    ln_growth: dict[str, list[dict]] = field(default_factory=dict)  # side -> [{step, growth, per_layer, source}]
    first_update: dict | None = None  # {value, step, lr, source}: ||F(x, theta_1) - F(x, theta_0)||
    deepnorm_first_update: dict | None = None  # {value, source}: the same of DeepNorm at this shape, seed and lr
    update_bound: dict | None = None  # {coefficient, deepnorm_coefficient, ratio}: DeepNet's bound, x lr
    max_logged_update: dict | None = None  # {value, step}: the largest update the diagnostics lines logged
    final_update: dict | None = None  # {value, step, relative}: at the checkpoint; relative to output_norm
    token_cosine: dict | None = None  # {last, first, per_layer, source}: mean token cosine similarity per layer
    last_lr: float | None = None  # the learning rate of the last logged training step
    eval_loss: dict | None = None  # {chance, best_eval, final_eval, evaluations}


@dataclass
class Diagnosis:
    """A run's diagnosis: its outcome, the problems found (``findings``), the checks that passed
    (``fine``), every measurement with its source, and what could not be measured (``notes``)."""

    run: str
    summary: str
    status: dict
    outcome: dict | None
    findings: list[Problem]
    fine: list[str]
    measurements: Measurements
    notes: list[str]

    @property
    def lines(self) -> list[str]:
        """The diagnosis as printed by ``kilolayer doctor RUN_DIR``."""
        out = [self.summary]
        if self.outcome is not None:
            label = self.outcome["label"] or self.outcome["status"]
            out.append(f"outcome: {label} ({self.outcome['why']})")
        for f in self.findings:
            out.append(f"- {f.text}")
            if f.suggestion:
                out.append(f"  -> {f.suggestion}")
        if not self.findings:
            out.append("- no problem found by the rules below")
        if self.fine:
            out.append("fine: " + "; ".join(self.fine))
        out += [f"note: {n}" for n in self.notes]
        return out

    @property
    def paragraph(self) -> str:
        """The diagnosis as one paragraph (what the study report shows next to a failed or diverged point):
        each problem with its evidence and its fix, then what could not be measured."""
        parts = []
        for f in self.findings:
            text = f.text[:1].upper() + f.text[1:]
            parts.append(f"{text}; fix: {f.suggestion}." if f.suggestion else f"{text}.")
        if not parts:
            parts.append("No problem found by the doctor's rules.")
        if self.notes:
            parts.append("Notes: " + "; ".join(n.rstrip(".") for n in self.notes) + ".")
        return " ".join(" ".join(p.split()) for p in parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lines"] = self.lines
        d["paragraph"] = self.paragraph
        return _json_safe(d)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _e(x: float) -> str:
    """A number for a diagnosis line: 3 significant digits, scientific when tiny or huge."""
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.1e}" if x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4) else f"{x:.3g}"


# ---------------------------------------------------------------- measurements -> numbers


def side_ratios(layers: list[str], norms: list[float]) -> dict[str, float]:
    """Per side: gradient norm of its first layer / its last layer's."""
    out = {}
    for side in ("encoder", "decoder"):
        idx = [i for i, n in enumerate(layers) if n.startswith(side + ".")]
        if len(idx) >= 2:
            bottom, top = norms[idx[0]], norms[idx[-1]]
            out[side] = bottom / top if top > 0 else math.nan
    return out


def ln_per_layer(names: list[str], values: list[float]) -> dict[str, list[float]]:
    """Per side: the mean input magnitude of each layer's residual-path LayerNorms (pre_norm/post_norm), by
    layer; inner and output norms and the final norm are left out."""
    sums: dict[str, dict[int, list[float]]] = {}
    for name, v in zip(names, values):
        m = LAYER_NORM.match(name)
        if m and math.isfinite(v):
            sums.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(v)
    return {side: [sum(v) / len(v) for _, v in sorted(layers.items())] for side, layers in sums.items()}


def ln_growth(names: list[str], values: list[float]) -> dict[str, float]:
    """Per side: last layer's mean LayerNorm input / first layer's (sides with at least two layers)."""
    out = {}
    for side, per in ln_per_layer(names, values).items():
        if len(per) >= 2 and per[0] > 0:
            out[side] = per[-1] / per[0]
    return out


# ---------------------------------------------------------------- the rules


def _shape(config: Config) -> str:
    return shape_name(config.model)


def _shallow(config: Config) -> str:
    """Why depth is not named for a model below DeepNet's depth, as the end of a line."""
    return f"at {_shape(config)}, below the {DEEP_LAYERS} layers per side where DeepNet shows depth's trouble"


def _alpha_text(config: Config) -> str:
    from kilolayer.nn.deepnorm import deepnorm_constants

    m = config.model
    consts = deepnorm_constants(m.arch, m.encoder_depth, m.decoder_depth)
    return ", ".join(f"{side} alpha {a:.2f}, beta {b:.2f}" for side, (a, b) in consts.items())


def gradient_findings(config: Config, m: Measurements) -> tuple[list[Problem], list[str]]:
    """Vanishing bottom gradients, from ``m.grad_ratio``."""
    findings, fine = [], []
    scheme = config.model.scheme
    for side, points in m.grad_ratio.items():
        finite = [p for p in points if math.isfinite(p["ratio"])]
        if not finite:
            continue
        worst = min(finite, key=lambda p: p["ratio"])
        steps = ", ".join(
            f"{_e(p['ratio'])} at step {p['step']}{' (checkpoint)' * (p['source'] == 'checkpoint')}" for p in finite
        )
        if worst["ratio"] < GRAD_RATIO:
            pattern = " (Post-LN's vanishing pattern)" if scheme in POST_LN_FORM else ""
            if scheme in POST_LN_FORM:  # the measured pattern DeepNorm's up-weighted shortcut removes
                fix = (
                    f"set model.scheme=deepnorm ({_alpha_text(config)}): DeepNet up-weights the shortcut so "
                    f"the gradient reaches the bottom layers; or model.scheme=pre_ln"
                )
            elif deep_enough(config.model):
                fix = "fewer layers, or a scheme whose shortcut carries the gradient (deepnorm, pre_ln)"
            else:
                fix = (
                    f"lower train.lr (now {_e(config.train.lr)}) or lengthen train.warmup (now "
                    f"{config.train.warmup}): large early updates inflate the LayerNorm inputs, which shrinks the "
                    f"gradient below them ({_shallow(config)}, depth is not the cause)"
                )
            findings.append(
                Problem(
                    "vanishing_gradients",
                    f"gradients at the bottom of the {side} are {_e(worst['ratio'])} of the top's at step "
                    f"{worst['step']}{pattern}; bottom/top per measured step: {steps} (flagged below {GRAD_RATIO:g})",
                    fix + f": the bottom {side} layers barely learn while the ratio is {_e(worst['ratio'])}",
                    {"side": side, "points": finite},
                )
            )
        else:
            fine.append(f"{side} bottom/top gradient {steps}")
    return findings, fine


def update_findings(config: Config, m: Measurements) -> tuple[list[Problem], list[str]]:
    """A large first update, from ``m.first_update``, ``m.deepnorm_first_update`` and ``m.update_bound``."""
    first, ref = m.first_update, m.deepnorm_first_update
    if not first or not math.isfinite(first["value"]):
        return [], []
    bound = m.update_bound
    bound_text = ""
    if bound and bound.get("ratio") is not None and config.model.scheme != "deepnorm":
        bound_text = (
            f"; DeepNet's bound for this scheme at {_shape(config)} is {bound['ratio']:.0f}x DeepNorm's "
            f"({bound['coefficient']:.4g} vs {bound['deepnorm_coefficient']:.3g} x lr: a bound, "
            f"not a prediction)"
        )
    if config.model.scheme == "deepnorm" or not ref or not ref.get("value"):
        if config.model.scheme == "deepnorm" and bound:
            return [], [
                f"first update {_e(first['value'])} at lr {_e(first['lr'])} (DeepNorm: its bound is "
                f"{bound['deepnorm_coefficient']:.3g} x lr at any depth)"
            ]
        return [], [f"first update {_e(first['value'])} at lr {_e(first['lr'])}"]
    ratio = first["value"] / ref["value"]
    if ratio >= UPDATE_RATIO and not deep_enough(config.model):
        # DeepNet's update grows with the number of sublayers: a shallow model's larger update is its scheme's
        # and init's ordinary size, not the burst that stalls a deep one
        return [], [
            f"first update {_e(first['value'])} = {ratio:.3g}x DeepNorm's at this shape and lr (not flagged "
            f"{_shallow(config)})"
        ]
    text = (
        f"the first update ||F(x,θ1) - F(x,θ0)|| is {_e(first['value'])}, {ratio:.3g}x that of a DeepNorm model "
        f"of this shape at the same lr {_e(first['lr'])} ({_e(ref['value'])}, measured: an empirical "
        f"reference){bound_text}"
    )
    evidence = {"update": first["value"], "deepnorm": ref["value"], "ratio": ratio, "lr": first["lr"]}
    if ratio >= UPDATE_RATIO:
        fix = (
            f"set model.scheme=deepnorm (bounded update at any depth), or divide train.lr by about "
            f"{ratio:.0f} / lengthen train.warmup (now {config.train.warmup}) so early updates stay near "
            f"DeepNorm's size"
        )
        return [Problem("large_update", text + f" (flagged at {UPDATE_RATIO:g}x)", fix, evidence)], []
    return [], [f"first update {_e(first['value'])} = {ratio:.2g}x DeepNorm's at this shape and lr"]


def ln_findings(config: Config, m: Measurements) -> tuple[list[Problem], list[str]]:
    """LayerNorm inputs growing with layer, from ``m.ln_growth``."""
    findings, fine = [], []
    for side, points in m.ln_growth.items():
        if not points:
            continue
        worst = max(points, key=lambda p: p["growth"])
        per = ", ".join(_e(v) for v in worst["per_layer"])
        pre_ln = config.model.scheme in ("pre_ln", "sub_ln", "sandwich_ln", "normformer", "layerscale")
        if worst["growth"] >= LN_GROWTH and pre_ln and not deep_enough(config.model):
            # a Pre-LN residual stream adds up every layer's output; over a few layers that is no weakness
            fine.append(
                f"{side} LayerNorm inputs {worst['growth']:.3g}x first to last layer (Pre-LN's residual stream "
                f"adds up each layer's output; not flagged {_shallow(config)})"
            )
        elif worst["growth"] >= LN_GROWTH:
            if pre_ln:
                why = (
                    "the residual stream outgrows what each layer adds, so the top layers change it little "
                    "(Pre-LN's weakness at depth)"
                )
                fix = (
                    "model.scheme=deepnorm keeps every LayerNorm input at the alpha-scaled level; or fewer, "
                    "wider layers"
                )
            else:
                why = "the branch outputs grow relative to the shortcut"
                fix = f"lower train.lr or lengthen train.warmup (now {config.train.warmup})"
            findings.append(
                Problem(
                    "ln_growth",
                    f"LayerNorm inputs grow layer by layer in the {side}: {worst['growth']:.3g}x from the first "
                    f"layer to the last at step {worst['step']} (per layer: {per}; flagged at {LN_GROWTH:g}x): {why}",
                    fix,
                    {"side": side, **worst},
                )
            )
        else:
            fine.append(f"{side} LayerNorm inputs {worst['growth']:.2g}x first to last layer")
    return findings, fine


def smoothing_findings(config: Config, m: Measurements) -> tuple[list[Problem], list[str]]:
    s = m.token_cosine
    if not s or not math.isfinite(s.get("last", math.nan)):
        return [], []
    cosine = f"last-layer token cosine {s['last']:.3f} (embedding {s['first']:.2f}"
    c = m.eval_loss or {}
    if s["last"] >= COSINE and learned_something(c.get("final_eval", math.nan), c.get("chance")) is False:
        # tokens of a model that learned nothing are alike for want of learning: not depth's over-smoothing
        return [], [f"{cosine}; not flagged: the run learned almost nothing, so alike tokens say nothing of depth)"]
    if s["last"] >= COSINE and not deep_enough(config.model):
        return [], [f"{cosine}; not flagged {_shallow(config)})"]
    if s["last"] >= COSINE:
        seq_level = config.objective.name in ("classification", "contrastive")
        why = " (a sequence-level objective: Bamboo's over-smoothing)" if seq_level else ""
        fix = (
            (
                "a token-level objective (MAE / MLM pre-training, then fine-tune) or fewer, wider layers: "
                "extra depth adds little while the last layers' tokens are this alike"
            )
            if seq_level
            else "fewer, wider layers: the last layers' tokens are nearly identical, so extra depth adds little"
        )
        return [
            Problem(
                "oversmoothing",
                f"last-layer tokens are {s['last']:.3f} similar (mean token cosine; {s['first']:.2f} after the "
                f"embedding; flagged at {COSINE:g}): over-smoothing{why}",
                fix,
                dict(s),
            )
        ], []
    return [], [f"{cosine})"]


def chance_findings(config: Config, m: Measurements, others: list[Problem]) -> tuple[list[Problem], list[str]]:
    c = m.eval_loss
    if not c or not math.isfinite(c.get("chance", math.nan)):
        return [], []
    best, final, level = c["best_eval"], c["final_eval"], c["chance"]
    if not math.isfinite(best):
        return [], []
    codes = {f.code for f in others}
    moved = m.final_update or {}
    if m.status == "diverged":
        fix = "the divergence above ended training before the model learned: fix that first"
    elif "vanishing_gradients" in codes:
        fix = "the vanishing gradients above are the likely cause: fix those first"
    elif moved.get("relative") is not None and moved["relative"] < BARELY_MOVED:
        fix = (
            f"the weights barely moved (output changed by {moved['relative']:.2g} of its size by step "
            f"{moved['step']}, flagged below {BARELY_MOVED:g}): raise train.lr (now {_e(config.train.lr)}) "
            f"or train longer"
        )
    elif "large_update" in codes or (moved.get("relative") or 0) > 1.0:
        fix = (
            "the model moved far but to no use: updates this large throw it back to chance; lower "
            f"train.lr (now {_e(config.train.lr)}) or lengthen train.warmup"
        )
    else:
        fix = "train longer, or check that the targets depend on the inputs"
    if best >= level:
        return [
            Problem(
                "never_below_chance",
                f"loss never went below the data's chance level: best eval loss {best:.4g} >= chance "
                f"{level:.4g} (the best input-independent predictor on these evaluation targets)",
                fix,
                dict(c),
            )
        ], []
    if learned_something(final, level) is False:
        return [
            Problem(
                "learned_nothing",
                f"standing eval loss {final:.4g} is {final / level:.2f} x the chance level {level:.4g}: learned "
                f"almost nothing (the study report's rule: above {LEARNED_NOTHING:g} x chance)",
                fix,
                dict(c),
            )
        ], []
    return [], [f"standing eval loss {final:.4g} = {final / level:.2f} x chance {level:.4g}"]


def status_findings(config: Config, status: dict, m: Measurements) -> list[Problem]:
    st = status.get("status")
    if st == "diverged":
        lr = m.last_lr
        warm = config.train.warmup
        where = (
            f" (lr {_e(lr)}, {'after' if status.get('step', 0) > warm else 'during'} the {warm}-step warm-up)"
            if lr is not None
            else ""
        )
        first = m.first_update or {}
        ref = (m.deepnorm_first_update or {}).get("value")
        tie = f"; its first update was {first['value'] / ref:.3g}x DeepNorm's" if first and ref else ""
        return [
            Problem(
                "diverged",
                f"diverged at step {status.get('step')}{where}: {status.get('reason', '')}",
                f"lower train.lr (peak {_e(config.train.lr)}) or lengthen train.warmup{tie}"
                + (
                    "; continue from the last good checkpoint with kilolayer train --resume --set train.lr=..."
                    if m.has_checkpoint
                    else ""
                ),
                {"step": status.get("step"), "reason": status.get("reason", "")},
            )
        ]
    if st == "failed":
        return [
            Problem(
                "failed",
                f"failed at step {status.get('step')}: {status.get('reason', '')}",
                "not a training outcome: fix the cause above and continue with kilolayer train --resume",
                {"step": status.get("step"), "reason": status.get("reason", "")},
            )
        ]
    return []


# ---------------------------------------------------------------- measuring a run


def _config_of(run: Path) -> Config:
    if not run.exists():
        raise InputError(f"{run}: no such run directory")
    if not run.is_dir():
        raise InputError(f"{run}: not a directory (give a kilolayer run directory)")
    if not (run / CONFIG).is_file():
        raise InputError(f"{run}: not a kilolayer run directory (no config.yaml)")
    return load_config(run / CONFIG)


def measure(
    run: Path,
    config: Config,
    records: list[dict],
    status: dict,
    record: RunRecord,
    *,
    replay_steps: int = 1,
    smoothness_samples: int = 128,
    device: str = "cpu",
) -> tuple[Measurements, list[str]]:
    """Every measurement the rules read, with its source, and notes on what could not be measured (``record``:
    the run's record, which holds its standing evaluation and chance level)."""
    from kilolayer.doctor.measure import at_checkpoint, deepnorm_first_update, replay

    m = Measurements(status=status.get("status"))
    notes: list[str] = []
    logged = read_diagnostics(records, run / METRICS)
    start = None
    if replay_steps > 0:
        try:
            start = replay(config, replay_steps, device)
        except KilolayerError as err:
            notes.append(f"step 1 not replayed (nothing measured from the seed or checkpoints): {err}")
    m.output_norm = start.output_norm if start else None

    # gradients and LayerNorm inputs: every logged step, or the replayed first step(s); (source, step's numbers)
    points = [("logged", d) for d in logged]
    if not points and start is not None:
        points = [("replayed", s) for s in start.steps]
        why = (
            "train.diagnostics_every=0"
            if not config.train.diagnostics_every
            else "none logged before the run stopped"
            if not records
            else "none logged"
        )
        notes.append(f"no diagnostics in metrics.jsonl ({why}): step 1 replayed from the seed")
    ckpt = None
    if start is not None:
        try:
            ckpt = at_checkpoint(run, config, start, device)
        except KilolayerError as err:
            notes.append(f"checkpoint not measured: {err}")
        if ckpt is None and not any("checkpoint not measured" in n for n in notes):
            notes.append("no complete checkpoint: nothing measured at the end of training")
    m.has_checkpoint = ckpt is not None
    if ckpt is not None and not any(d.step == ckpt.step for _, d in points):
        points.append(("checkpoint", ckpt))
    if ckpt is not None:
        rel = ckpt.update / start.output_norm if start.output_norm else None
        m.final_update = {"value": ckpt.update, "step": ckpt.step, "relative": rel}
    early = [p for p in points if p[0] != "checkpoint"]
    chosen = ([early[0], early[-1]] if len(early) > 1 else early) + [p for p in points if p[0] == "checkpoint"]
    for source, d in chosen:
        for side, r in side_ratios(d.layers, d.grad_norm).items():
            m.grad_ratio.setdefault(side, []).append({"step": d.step, "ratio": r, "source": source})
        per = ln_per_layer(d.ln_names, d.ln_input)
        for side, g in ln_growth(d.ln_names, d.ln_input).items():
            m.ln_growth.setdefault(side, []).append(
                {"step": d.step, "growth": g, "per_layer": per[side], "source": source}
            )

    # the first update, against DeepNorm's at the same shape and lr (empirical) and DeepNet's bound (theory)
    first = next(((source, d) for source, d in points if d.step == 1 and math.isfinite(d.update)), None)
    if first is None and start is not None and start.steps and math.isfinite(start.steps[0].update):
        first = ("replayed", start.steps[0])
    if first is not None:
        lr1 = start.steps[0].lr if start and start.steps else config.train.lr
        m.first_update = {"value": first[1].update, "step": 1, "lr": lr1, "source": first[0]}
    if logged:
        top = max(logged, key=lambda d: d.update if math.isfinite(d.update) else -1)
        m.max_logged_update = {"value": top.update, "step": top.step}
    if first is not None and config.model.scheme != "deepnorm" and start is not None:
        ref = deepnorm_first_update(config, device)
        if ref is not None:
            m.deepnorm_first_update = {"value": ref, "source": "replayed (model.scheme=deepnorm, same seed)"}
    own, dn = update_coefficient(config.model), update_coefficient(config.model, "deepnorm")
    if dn is not None:
        m.update_bound = {
            "coefficient": own,
            "deepnorm_coefficient": dn,
            "ratio": own / dn if own is not None else None,
        }

    # tokens: the study's cached analysis, or measured through the observer
    m.token_cosine = _smoothness(record, smoothness_samples, device, notes, has_checkpoint=ckpt is not None)

    # losses against the chance level
    evals = [logged_number(r.get("loss")) for r in records if r.get("split") == "eval" and "loss" in r]
    trains = [
        (int(r["step"]), logged_number(r.get("loss")), logged_number(r.get("lr")))
        for r in records
        if r.get("split") == "train" and "loss" in r
    ]
    if trains:
        m.last_lr = next((lr for _, _, lr in reversed(trains) if math.isfinite(lr)), None)
    try:
        level = record.chance_level()["loss"]
    except KilolayerError as err:
        level = math.nan
        notes.append(f"chance level not computed: {err}")
    finite_evals = [e for e in evals if math.isfinite(e)]
    if finite_evals:
        m.eval_loss = {
            "chance": level,
            "best_eval": min(finite_evals),
            "final_eval": record.eval_loss,  # the evaluation that stands for the run, as the verdicts read it
            "evaluations": len(evals),
        }
    elif math.isfinite(level):
        notes.append("no evaluation loss logged: the chance check needs one")
    return m, notes


def _smoothness(record: RunRecord, samples: int, device: str, notes: list[str], has_checkpoint: bool) -> dict | None:
    cached = record.smoothness
    if cached and cached.get("cosine"):
        result, source = cached, "RUN/analysis/smoothness/smoothness.json"
    elif samples > 0 and has_checkpoint:
        from kilolayer.analysis.smoothness import smoothness_of_run

        try:
            result = smoothness_of_run(record.path, samples=samples, device=device)
            source = "measured at the checkpoint"
        except KilolayerError as err:
            notes.append(f"token similarity not measured: {err}")
            return None
    else:
        return None
    cos = [logged_number(v) for v in result["cosine"]]
    return {"last": cos[-1], "first": cos[0], "per_layer": cos, "source": source}


def diagnose(
    run_dir: str | Path, *, replay_steps: int = 1, smoothness_samples: int = 128, device: str = "cpu"
) -> Diagnosis:
    """Diagnose the run in ``run_dir`` (see the module docstring for what is measured and the rules).

    ``replay_steps=0`` and ``smoothness_samples=0`` skip the measurements that build the model (then only
    what metrics.jsonl and the caches hold is used). Raises :class:`~kilolayer.errors.InputError` (one
    line) for a directory that is not a run."""
    from kilolayer.doctor.outcome import outcome

    run = Path(run_dir)
    config = _config_of(run)
    records = read_metrics(run)
    status = read_status(run)
    record = RunRecord.read(run, config, read_only=True, records=records)
    if config.train.precision == "auto" and record.precision:  # replayed at the precision the run trained at
        config = load_config(
            {**config.model_dump(), "train": {**config.train.model_dump(), "precision": record.precision}}
        )
    m, notes = measure(
        run,
        config,
        records,
        status,
        record,
        replay_steps=replay_steps,
        smoothness_samples=smoothness_samples,
        device=device,
    )
    found, fine = [], []
    for rule in (gradient_findings, update_findings, ln_findings, smoothing_findings):
        f, ok = rule(config, m)
        found += f
        fine += ok
    f, ok = chance_findings(config, m, found)
    found += f
    fine += ok
    found = status_findings(config, status, m) + found
    out = None
    try:
        out = outcome(run, config, record).to_dict()
    except KilolayerError as err:
        notes.append(f"outcome not decided: {err}")
    mc = config.model
    st = status.get("status") or ("status.json unreadable" if (run / "status.json").exists() else "no status.json")
    precision = f", {record.precision}" if record.precision else ""
    summary = (
        f"{run}: {mc.scheme} {mc.arch} {_shape(config)} x {mc.width}, {config.objective.name} on "
        f"{config.data.name}; {st} at step {status.get('step', '?')} of {config.train.steps} "
        f"(lr {_e(config.train.lr)}, warm-up {config.train.warmup}, {config.train.schedule}{precision})"
    )
    return Diagnosis(
        str(run),
        summary,
        {k: status.get(k) for k in ("status", "step", "reason", "precision", "precision_reason") if k in status},
        out,
        found,
        fine,
        m,
        notes,
    )
