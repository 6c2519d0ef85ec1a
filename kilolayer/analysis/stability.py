"""DeepNet's stability diagnostics, read back from a run's ``metrics.jsonl``.

The trainer logs, every ``train.diagnostics_every`` steps, one line

    {"step": s, "split": "diagnostics", "layers": [...], "grad_norm": [...],
     "update": ||F(x, theta_t) - F(x, theta_0)||, "ln_names": [...], "ln_input": [...]}

next to the ordinary ``{"step", "split": "train"|"eval", "loss", ...}`` lines.
This module turns those lines into per-run series for :mod:`kilolayer.analysis.plots`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from kilolayer.errors import InputError
from kilolayer.rundir import METRICS, logged_number, read_metrics


@dataclass
class Diagnostics:
    """One diagnostics line."""

    step: int
    layers: list[str] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    update: float = math.nan
    ln_names: list[str] = field(default_factory=list)
    ln_input: list[float] = field(default_factory=list)


@dataclass
class StabilityRun:
    """A run's diagnostics (sorted by step) and its loss curves (``split -> [(step, loss)]``)."""

    name: str
    path: Path
    diagnostics: list[Diagnostics]
    losses: dict[str, list[tuple[int, float]]]

    def at(self, step: int) -> Diagnostics:
        """The diagnostics line nearest to ``step``."""
        return min(self.diagnostics, key=lambda d: abs(d.step - step))


def _diagnostics(record: dict, where: str) -> Diagnostics:
    d = Diagnostics(step=int(record["step"]), update=logged_number(record.get("update")))
    for names_key, values_key in (("layers", "grad_norm"), ("ln_names", "ln_input")):
        names, values = record.get(names_key) or [], record.get(values_key) or []
        if not isinstance(names, list) or not isinstance(values, list) or len(names) != len(values):
            raise InputError(f"{where}: '{names_key}' and '{values_key}' must be lists of the same length")
        setattr(d, names_key, [str(n) for n in names])
        setattr(d, values_key, [logged_number(v) for v in values])
    return d


def read_diagnostics(records: list[dict], path: str | Path) -> list[Diagnostics]:
    """The diagnostics lines among the records of ``path`` (a run's metrics.jsonl, named in errors), by step."""
    found = [
        _diagnostics(r, f"{path} (diagnostics at step {r['step']})") for r in records if r.get("split") == "diagnostics"
    ]
    return sorted(found, key=lambda d: d.step)


def read_run(run: str | Path, name: str | None = None) -> StabilityRun:
    """A run directory (or its ``metrics.jsonl``) as a :class:`StabilityRun`; the name defaults to the
    directory's name."""
    run = Path(run)
    path = run if run.is_file() else run / METRICS
    if not run.exists():
        raise InputError(f"--run {run}: no such run directory")
    if not path.is_file():
        raise InputError(f"--run {run}: no metrics.jsonl (not a kilolayer run directory?)")
    records = read_metrics(path)
    diagnostics, losses = read_diagnostics(records, path), {}
    for record in records:
        split = record.get("split")
        if split != "diagnostics" and "loss" in record and split is not None:
            losses.setdefault(str(split), []).append((int(record["step"]), logged_number(record["loss"])))
    if not diagnostics:
        raise InputError(
            f"--run {run}: metrics.jsonl has no diagnostics lines (train with train.diagnostics_every > 0)"
        )
    for series in losses.values():
        series.sort()
    run_dir = path.parent
    return StabilityRun(name or run_dir.resolve().name, run_dir, diagnostics, losses)


def read_runs(runs: list[str | Path]) -> list[StabilityRun]:
    """Several runs; names that collide get their parent directory prefixed."""
    out = [read_run(r) for r in runs]
    names = [r.name for r in out]
    for r in out:
        if names.count(r.name) > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.name}"
    return out


def pick_steps(runs: list[StabilityRun], count: int = 3) -> list[int]:
    """Up to ``count`` diagnostics steps spread from the first to the last (of the first run)."""
    steps = [d.step for d in runs[0].diagnostics]
    if len(steps) <= count:
        return steps
    idx = sorted({round(k * (len(steps) - 1) / (count - 1)) for k in range(count)})
    return [steps[i] for i in idx]


def summary(runs: list[StabilityRun]) -> dict:
    """Per run: the model update at every diagnostics step and the largest LayerNorm input seen."""
    out = {}
    for r in runs:
        out[r.name] = {
            "path": str(r.path.resolve()),
            "steps": [d.step for d in r.diagnostics],
            "update": [d.update for d in r.diagnostics],
            "max_ln_input": max((v for d in r.diagnostics for v in d.ln_input if math.isfinite(v)), default=math.nan),
        }
    return out


def top_stack(layers: list[str]) -> list[int]:
    """The indices of ``layers`` (names ``<stack>.<i>``, in forward order) that belong to the top stack, the
    decoder of an encoder-decoder, bottom to top."""
    if not layers:
        return []
    top = layers[-1].split(".")[0]
    return [i for i, name in enumerate(layers) if name.split(".")[0] == top]


def mean_log_gradients(diagnostics: list[Diagnostics], steps) -> list[float] | None:
    """Per layer, the mean of ln(gradient norm) over the diagnostics lines at ``steps`` (the log of the geometric
    mean); NaN for a layer whose norm is not positive and finite at one of those steps (a vanished or blown-up
    gradient has no logarithm to average). None when ``steps`` selects no line or the lines name different
    layers."""
    wanted = set(steps)
    chosen = [d for d in diagnostics if d.step in wanted]
    if not chosen or any(d.layers != chosen[0].layers for d in chosen):
        return None
    logs = []
    for i in range(len(chosen[0].layers)):
        values = [d.grad_norm[i] for d in chosen]
        ok = all(math.isfinite(v) and v > 0 for v in values)
        logs.append(sum(math.log(v) for v in values) / len(values) if ok else math.nan)
    return logs
