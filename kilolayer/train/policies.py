"""The rules that end a run: divergence and early stopping.

Each is a small object with the state it needs and ``state_dict``/``load_state_dict`` under the keys a
checkpoint's ``state.json`` keeps them in, so a resumed run continues them exactly.
"""

from __future__ import annotations

import math

# early_stop_mode auto: these evaluation metrics (and the ends of their intervals, ``bleu_low``) are better
# higher, every other one lower
HIGHER_IS_BETTER = ("accuracy", "exact_match", "bleu", "chrf")


def early_stop_mode(tc) -> str:
    """``min`` or ``max``: whether lower or higher values of ``train.early_stop_metric`` are better."""
    if tc.early_stop_mode != "auto":
        return tc.early_stop_mode
    name = tc.early_stop_metric.removesuffix("_low").removesuffix("_high")
    return "max" if name in HIGHER_IS_BETTER or name.endswith("accuracy") else "min"


class DivergenceRule:
    """A run has diverged at a non-finite loss, or after warm-up (``train.warmup`` steps) when its smoothed loss
    (EMA with weight 0.9, bias-corrected) exceeds ``train.diverge_factor`` x its running minimum and that minimum
    by ``train.diverge_increase``. ``ungated`` is the first step at which the ratio test held during warm-up,
    where it is not applied (the doctor reports it)."""

    KEYS = ("ema", "ema_weight", "running_min")

    def __init__(self, tc):
        self.factor, self.increase, self.warmup = tc.diverge_factor, tc.diverge_increase, tc.warmup
        self.ema = self.ema_weight = 0.0
        self.running_min = math.inf
        self.ungated: int | None = None

    def __call__(self, step: int, loss: float) -> str:
        """Why the run has diverged at ``step`` ("" if it has not); updates the smoothed loss and its minimum."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss}) at step {step}"
        self.ema = 0.9 * self.ema + 0.1 * loss
        self.ema_weight = 0.9 * self.ema_weight + 0.1
        smooth = self.ema / self.ema_weight
        best = self.running_min
        if smooth > self.factor * best and smooth > best + self.increase:
            if step > self.warmup:
                return (
                    f"smoothed loss {smooth:.4g} at step {step} exceeds {self.factor:g} x its running minimum "
                    f"{best:.4g}"
                )
            if self.ungated is None:
                self.ungated = step
        self.running_min = min(best, smooth)
        return ""

    def state_dict(self) -> dict:
        return {"ema": self.ema, "ema_weight": self.ema_weight, "running_min": self.running_min}

    def load_state_dict(self, state: dict) -> None:
        self.ema, self.ema_weight, self.running_min = (float(state[k]) for k in self.KEYS)


class EarlyStopping:
    """With ``train.patience`` > 0: stop once that many evaluations in a row have not improved
    ``train.early_stop_metric`` by ``train.min_delta`` (in the direction of :func:`early_stop_mode`)."""

    def __init__(self, tc):
        self.patience, self.metric, self.mode, self.min_delta = (
            tc.patience,
            tc.early_stop_metric,
            early_stop_mode(tc),
            tc.min_delta,
        )
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_evals = 0

    @property
    def active(self) -> bool:
        return bool(self.patience)

    def track(self, step: int, metrics: dict) -> bool:
        """Count an evaluation; True if ``step`` is the new best (a missing or non-finite value never is)."""
        value = float(metrics.get(self.metric, math.nan))
        sign = 1.0 if self.mode == "min" else -1.0
        better = math.isfinite(value) and (self.best is None or sign * value < sign * self.best - self.min_delta)
        if better:
            self.best, self.best_step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1
        return better

    @property
    def plateaued(self) -> bool:
        return self.active and self.bad_evals >= self.patience

    def reason(self) -> str:
        best = f"; best {self.best:.6g} at step {self.best_step}" if self.best is not None else ""
        return f"plateau: no improvement of {self.metric} by {self.min_delta:g} in {self.patience} evaluations{best}"

    def state_dict(self) -> dict:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "bad_evals": self.bad_evals,
            "early_stop_metric": self.metric,
            "early_stop_mode": self.mode,
            "min_delta": self.min_delta,
        }

    def resume(self, saved: dict, step: int) -> str:
        """Continue from the state of a checkpoint at ``step``. The best and the count carry on only under the
        metric and mode they were found with; under another they start over, and the returned line says what
        was dropped ("" otherwise). A changed ``min_delta`` applies from here on."""
        best, best_step, bad = saved.get("best"), saved.get("best_step"), int(saved.get("bad_evals", 0))
        was = (saved.get("early_stop_metric", self.metric), saved.get("early_stop_mode", self.mode))
        if was == (self.metric, self.mode):
            self.best, self.best_step, self.bad_evals = best, best_step, bad
            return ""
        if best is None and not bad:
            return ""
        kept = f"best {best:.6g} at step {best_step}, " if best is not None else ""
        return (
            f"train.early_stop_metric={self.metric!r} (mode {self.mode}): the run tracked {was[0]!r} (mode "
            f"{was[1]}) until step {step}; early stopping starts over ({kept}{bad} evaluations without "
            f"improvement dropped)"
        )
