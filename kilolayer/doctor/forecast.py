"""``forecast(config)``: will this config train, stall or diverge? Decided before any run exists.

The forecast replays the config's first steps in memory (:func:`kilolayer.doctor.measure.replay`: the
run's own seed, initialisation, batches, AdamW and learning-rate schedule), measures what ``kilolayer
doctor`` reads from a finished run, and applies :func:`decide`, a rule of a few stated thresholds.
Nothing is written to disk.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from kilolayer.analysis.chance import LEARNED_NOTHING
from kilolayer.config import Config
from kilolayer.doctor.theory import shape_name

VERSION = 1  # of the measurements: calibration caches are re-measured when it changes
MAX_AUTO_STEPS = 200


def auto_steps(config: Config) -> int:
    """Steps replayed by default: through the warm-up and 10 steps at the peak learning rate (at least 40,
    at most 200 and at most train.steps)."""
    tc = config.train
    return max(1, min(tc.steps, MAX_AUTO_STEPS, max(40, tc.warmup + 10)))


def lr_sum(config: Config, first: int, last: int) -> float:
    """Sum of the scheduled learning rate over steps first..last (1-based, inclusive)."""
    from kilolayer.train.optim import lr_factor

    tc = config.train
    return sum(tc.lr * lr_factor(s - 1, tc) for s in range(first, last + 1))


def measure(config: Config, steps: int | None = None, device: str = "cpu") -> dict:
    """Replay ``steps`` steps (default :func:`auto_steps`) and return every measurement :func:`decide`
    reads, as plain JSON-able data."""
    return _measure(config, steps, device)[0]


def _measure(config: Config, steps: int | None, device: str, keep_state: bool = False) -> tuple[dict, dict | None]:
    """(:func:`measure`'s measurements, the replay's state after its last step when ``keep_state`` and it ran
    every step, else None)."""
    from kilolayer.doctor.diagnose import ln_growth, side_ratios
    from kilolayer.doctor.measure import deepnorm_first_update, replay
    from kilolayer.doctor.outcome import chance
    from kilolayer.doctor.theory import deep_enough, update_coefficient
    from kilolayer.errors import ConfigError

    if config.train.steps < 1:
        raise ConfigError("train.steps=0: nothing to forecast (the config trains no step)")
    t0 = time.perf_counter()
    k = min(steps or auto_steps(config), config.train.steps)
    every = max(1, k // 20)
    r = replay(config, k, device, eval_every=every, keep_state=keep_state)
    tc = config.train
    ran = len(r.steps)
    ok = [s for s in r.steps if math.isfinite(s.update)]
    m = {
        "version": VERSION,
        "steps_requested": k,
        "steps_run": ran,
        "stopped": r.stopped,
        "ungated": r.ungated,
        "schedule": {
            "lr": tc.lr,
            "warmup": tc.warmup,
            "steps": tc.steps,
            "schedule": tc.schedule,
            "lr_seen_max": max((s.lr for s in r.steps), default=0.0),
            "lr_sum_seen": lr_sum(config, 1, ran),
            "lr_sum_total": lr_sum(config, 1, tc.steps),
        },
        "scheme": config.model.scheme,
        "deep": deep_enough(config.model),
        "output_norm": r.output_norm,
        "eval_loss0": r.eval_loss0,
        "has_layernorm": bool(r.ln_names),
        "per_step": {
            "step": [s.step for s in r.steps],
            "lr": [s.lr for s in r.steps],
            "loss": [s.loss for s in r.steps],
            "update": [s.update for s in r.steps],
            "change": [s.change for s in r.steps],
            "eval_loss": [s.eval_loss for s in r.steps],
            "grad_ratio": [side_ratios(s.layers, s.grad_norm) for s in r.steps],
            "ln_growth": [ln_growth(s.ln_names, s.ln_input) if s.ln_names else {} for s in r.steps],
        },
        "update1": ok[0].update if ok and ok[0].step == 1 else None,
        "deepnorm_update1": None,
        "bound": {
            "coefficient": update_coefficient(config.model),
            "deepnorm_coefficient": update_coefficient(config.model, "deepnorm"),
        },
    }
    m["steps_twin"] = 0  # steps replayed of the DeepNorm twin (its first update)
    if config.model.scheme == "deepnorm":
        m["deepnorm_update1"] = m["update1"]
    else:
        m["deepnorm_update1"] = deepnorm_first_update(config, device)
        m["steps_twin"] = 0 if config.train.init_from else 1
    try:
        level = chance(config)
    except NotImplementedError:
        level = {}
    m["chance"] = level.get("loss", math.nan)
    m["seconds"] = time.perf_counter() - t0
    return m, r.state


# ---------------------------------------------------------------- the rule

# thresholds of the rule (docs/doctor.md says how each was chosen)
THROWN_BACK = 0.1  # the eval loss risen this far (in units of chance) above its lowest value: thrown back
VANISHED = 1e-3  # bottom/top gradient ratio below this at the end of the replay: the bottom layers are cut off
UPDATE_RATIO = 10.0  # first update at least this many times DeepNorm's: a warning, not a verdict
PEAK_CHANGE = 0.5  # projected one-step change of the output at the peak lr, as a fraction of its size: blow-up
SLOW_DOWN = 0.5  # the loss's recent pace (per unit of summed lr) is assumed to halve over the rest of the run
RULE = [
    "diverges: the replay met the engine's divergence rule (a non-finite loss, or the smoothed loss above "
    "train.diverge_factor x its running minimum after warm-up), or met its ratio test during warm-up "
    "(where the trainer does not apply it yet)",
    f"stalls (thrown back): the evaluation loss rose more than {THROWN_BACK:g} x chance above its lowest value "
    f"and ends above {LEARNED_NOTHING:g} x chance",
    f"stalls (cut off): at the last replayed step the bottom layer's gradient is below {VANISHED:g} x the top "
    f"layer's on a side (DeepNet's vanishing pattern)",
    f"if the replay ended before the peak learning rate: blows up when one step at the peak lr would move the "
    f"output by {PEAK_CHANGE:g} x its own size or more (the last 5 steps' change per unit lr, times the peak lr): "
    f"diverges without LayerNorm, stalls with it",
    f"stalls (too slow): the evaluation loss, extrapolated from the second half of the replay at {SLOW_DOWN:g} x "
    f"its pace per unit of summed learning rate to train.steps, stays above {LEARNED_NOTHING:g} x chance",
    "trains: otherwise",
]


def _finite(xs):
    return [x for x in xs if x is not None and math.isfinite(x)]


def peak_change(m: dict) -> float:
    """The output's change in one step at the peak learning rate, as a fraction of the output's size,
    projected linearly from the last 5 replayed steps (median of change / lr)."""
    import statistics

    ps = m["per_step"]
    per_lr = _finite([c / lr for c, lr in zip(ps["change"][-5:], ps["lr"][-5:]) if lr > 0 and c is not None])
    if not per_lr or not m["output_norm"]:
        return math.nan
    return statistics.median(per_lr) * m["schedule"]["lr"] / m["output_norm"]


def decide(m: dict) -> tuple[str, str, dict]:
    """(verdict, reason, the numbers the rule used) for measurements ``m`` of :func:`measure`; the first
    line of :data:`RULE` that holds decides."""
    level = m["chance"]
    ps = m["per_step"]
    sched = m["schedule"]
    if m["stopped"]:
        return "diverges", f"the replay diverged: {m['stopped']}", {}
    if m["ungated"] is not None:
        return (
            "diverges",
            (
                f"the smoothed loss passed train.diverge_factor x its running minimum at step "
                f"{m['ungated']}, during warm-up: the trainer will stop it when warm-up ends"
            ),
            {},
        )
    evals = [(s, e) for s, e in zip(ps["step"], ps["eval_loss"]) if e is not None and math.isfinite(e)]
    if not evals or not math.isfinite(level):
        return "trains", "no evaluation loss or chance level to judge by", {}
    e0 = m["eval_loss0"]
    lowest = min(_finite([e for _, e in evals] + [e0]))
    last_step, last = evals[-1]
    numbers = {
        "chance": level,
        "eval_loss0": e0,
        "eval_loss_lowest": lowest,
        "eval_loss_last": last,
        "step_last": last_step,
    }
    if last - lowest > THROWN_BACK * level and last > LEARNED_NOTHING * level:
        return (
            "stalls",
            (
                f"the evaluation loss fell to {lowest / level:.2f} x chance and was thrown back to "
                f"{last / level:.2f} x chance by step {last_step} (lr {ps['lr'][-1]:.2g})"
            ),
            numbers,
        )
    ratios = ps["grad_ratio"][-1] if ps["grad_ratio"] else {}
    cut = {side: r for side, r in ratios.items() if math.isfinite(r) and r < VANISHED}
    numbers["grad_ratio_last"] = ratios
    if cut:
        side, r = min(cut.items(), key=lambda kv: kv[1])
        return (
            "stalls",
            (
                f"at step {ps['step'][-1]} the gradient at the bottom of the {side} is {r:.1e} of the "
                f"top's: the bottom layers are cut off (DeepNet's vanishing pattern)"
            ),
            numbers,
        )
    if sched["lr_seen_max"] < 0.999 * sched["lr"]:
        r = peak_change(m)
        numbers["peak_change"] = r
        if r >= PEAK_CHANGE:
            has_ln = m.get("has_layernorm", any(ps["ln_growth"]))
            verdict = "stalls" if has_ln else "diverges"
            return (
                verdict,
                (
                    f"one step at the peak lr {sched['lr']:.2g} would move the output by {r:.2f} x its size "
                    f"(projected from step {ps['step'][-1]}, lr {ps['lr'][-1]:.2g}): it will blow up"
                    f"{' and be thrown back to chance' if verdict == 'stalls' else ''}"
                ),
                numbers,
            )
    half = [(s, e) for s, e in evals if s >= last_step / 2]
    s1, e1 = half[0]
    spent = sum(lr for s, lr in zip(ps["step"], ps["lr"]) if s1 < s <= last_step)
    rate = max(0.0, (e1 - last) / spent) if spent > 0 and s1 < last_step else 0.0
    remaining = max(0.0, sched["lr_sum_total"] - sched["lr_sum_seen"])
    projected = last - SLOW_DOWN * rate * remaining
    numbers.update(rate=rate, remaining_lr=remaining, projected=projected)
    if projected > LEARNED_NOTHING * level:
        return (
            "stalls",
            (
                f"the evaluation loss is {last / level:.2f} x chance at step {last_step} and, at half its "
                f"recent pace, would reach only {projected / level:.2f} x chance by step "
                f"{sched['steps']}"
            ),
            numbers,
        )
    if last <= LEARNED_NOTHING * level:
        return (
            "trains",
            (
                f"the evaluation loss is already {last / level:.2f} x chance at step {last_step}, below "
                f"{LEARNED_NOTHING:g} x chance, with no setback"
            ),
            numbers,
        )
    # where the straight line at half the recent pace crosses the line, as a share of the learning rate to come
    # (the line itself runs on past it, below zero on a steep descent: no loss it could reach)
    share = (last - LEARNED_NOTHING * level) / (SLOW_DOWN * rate * remaining)
    numbers["crossing_share"] = share
    return (
        "trains",
        (
            f"the evaluation loss is {last / level:.2f} x chance at step {last_step} and heading below "
            f"{LEARNED_NOTHING:g} x chance by step {sched['steps']}: at half its recent pace per unit of learning "
            f"rate it crosses that line after {'<1%' if share < 0.01 else f'{share:.0%}'} of the summed learning "
            "rate still to come (a share of the schedule's rate, not of its steps)"
        ),
        numbers,
    )


def warnings(m: dict) -> list[str]:
    """DeepNet's patterns in the replay, with what to change (they explain a verdict; only the cut-off
    gradients also decide one, rule 3)."""
    out = []
    ps = m["per_step"]
    ratios = ps["grad_ratio"][-1] if ps["grad_ratio"] else {}
    for side, r in sorted(ratios.items()):
        if math.isfinite(r) and r < VANISHED:
            out.append(
                f"at step {ps['step'][-1]} the bottom of the {side} gets {r:.1e} of the top's gradient "
                f"(DeepNet's vanishing pattern, flagged below {VANISHED:g}): only its top layers learn; "
                f"model.scheme=deepnorm keeps the bottom ones"
            )
    u1, dn = m.get("update1"), m.get("deepnorm_update1")
    if u1 and dn and u1 / dn >= UPDATE_RATIO and m["deep"]:  # a shallow model's: see diagnose.update_findings
        out.append(
            f"the first update is {u1 / dn:.3g}x a DeepNorm model's of this shape (flagged at "
            f"{UPDATE_RATIO:g}x): model.scheme=deepnorm, or a lower train.lr / longer train.warmup"
        )
    return out


@dataclass
class Forecast:
    """The verdict, its reason, the rule, and every measurement behind them."""

    config: str
    verdict: str
    reason: str
    numbers: dict
    measurements: dict
    notes: list[str] = field(default_factory=list)
    state: dict | None = None  # with keep_state: the replay's state after its last step (never in to_dict)

    @property
    def lines(self) -> list[str]:
        m = self.measurements
        out = [f"{self.config}", f"forecast: {self.verdict} — {self.reason}"]
        out += [f"warning: {line}" for line in warnings(m)]
        out += [f"evidence: {line}" for line in evidence_lines(m)]
        out.append(
            f"replayed {m['steps_run']} of {m['schedule']['steps']} steps in memory in {m['seconds']:.0f} s "
            f"(lr up to {m['schedule']['lr_seen_max']:.2g} of peak {m['schedule']['lr']:.2g}); nothing "
            f"written"
        )
        out.append("rule (first that holds): " + "; ".join(RULE))
        out += [f"note: {n}" for n in self.notes]
        return out

    def to_dict(self) -> dict:
        from kilolayer.doctor.diagnose import _json_safe

        return _json_safe(
            {
                "config": self.config,
                "verdict": self.verdict,
                "reason": self.reason,
                "warnings": warnings(self.measurements),
                "rule": RULE,
                "numbers": self.numbers,
                "measurements": self.measurements,
                "notes": self.notes,
                "lines": self.lines,
            }
        )


def evidence_lines(m: dict) -> list[str]:
    """DeepNet's measurements of the replay, one line each, for the forecast's printout."""
    out = []
    u1, dn = m.get("update1"), m.get("deepnorm_update1")
    b = m.get("bound") or {}
    if u1 is not None and m.get("scheme") == "deepnorm":
        out.append(
            f"first update {u1:.3g} (DeepNorm: DeepNet bounds it by {b['deepnorm_coefficient']:.3g} x lr at any depth)"
        )
    elif u1 is not None:
        text = f"first update {u1:.3g}"
        if dn:
            text += f" = {u1 / dn:.3g}x a DeepNorm model's of this shape at the same lr ({dn:.3g}; measured)"
        if b.get("coefficient") is not None and b.get("deepnorm_coefficient"):
            text += (
                f"; DeepNet's bound {b['coefficient']:.4g} x lr vs DeepNorm's {b['deepnorm_coefficient']:.3g} "
                f"x lr (a bound, not a prediction)"
            )
        out.append(text)
    ratios = m["per_step"]["grad_ratio"]
    if ratios:
        first = ratios[0]
        out.append("bottom/top gradient at step 1: " + ", ".join(f"{side} {v:.2g}" for side, v in first.items()))
    growth = [g for g in m["per_step"]["ln_growth"] if g]
    if growth:
        out.append(
            "LayerNorm input growth first to last layer at the last step: "
            + ", ".join(f"{side} {v:.2g}x" for side, v in growth[-1].items())
        )
    return out


def forecast(
    config: Config, steps: int | None = None, device: str = "cpu", name: str = "", keep_state: bool = False
) -> Forecast:
    """Forecast ``config`` (see module docstring): replay ``steps`` steps (default :func:`auto_steps`)
    and decide trains / stalls / diverges by :func:`decide`. With ``keep_state``, :attr:`Forecast.state` is the
    replay's state after its last step (a run of ``config`` can continue from it: ``kilolayer search`` starts
    its trials there)."""
    m, state = _measure(config, steps, device, keep_state)
    verdict, reason, numbers = decide(m)
    mc = config.model
    title = (
        f"{name + ': ' if name else ''}{mc.scheme} {mc.arch} {shape_name(mc)} x {mc.width}, {config.objective.name} on "
        f"{config.data.name}, lr {config.train.lr:.2g}, warm-up {config.train.warmup}, "
        f"{config.train.schedule}, {config.train.steps} steps"
    )
    notes = []
    if m["steps_run"] < m["schedule"]["steps"] and m["schedule"]["lr_seen_max"] < 0.999 * m["schedule"]["lr"]:
        notes.append(
            f"the replay ended before the peak learning rate ({m['schedule']['lr_seen_max']:.2g} of "
            f"{m['schedule']['lr']:.2g}): give --steps {config.train.warmup + 10} to see it"
        )
    return Forecast(title, verdict, reason, numbers, m, notes, state)
