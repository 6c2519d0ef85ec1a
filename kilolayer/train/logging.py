"""Run outputs: metrics.jsonl (through kilolayer.rundir), TensorBoard events, progress."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from kilolayer import rundir
from kilolayer.objectives.baselines import translates

# metrics and status files live in kilolayer.rundir; re-exported for callers that import them here
from kilolayer.rundir import read_metrics, truncate_metrics, write_status  # noqa: F401


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (flushed per line) and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.file = rundir.MetricsFile(run_dir)
        self.path = self.file.path
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict) -> None:
        self.file.append(record)
        if self.tb is not None:
            split = record.get("split", "train")
            for k, v in record.items():
                if k not in ("step", "split") and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"{split}/{k}", v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError:
                pass  # a full disk: reported where training failed


class Progress:
    """A rich progress bar on a terminal; plain periodic lines otherwise (logs, CI)."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.t0, self.s0 = time.perf_counter(), start
        self.bar = None
        if self.tty:
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.description}"),
                TimeRemainingColumn(),
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=total, completed=start)

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=step, description=text)
        else:
            done = step - self.s0
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / done * (self.total - step) if done else float("nan")
            self._say(f"step {step}/{self.total} {text} eta {eta:.0f}s")

    def note(self, text: str) -> None:
        """A line of its own (an evaluation's), above the bar on a terminal."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            self._say(text)

    def _say(self, text: str) -> None:
        # a reader that has gone (piped into `head`) ends the progress output, never the run
        self.enabled = rundir.say(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def eval_line(what: str, metrics: dict, baselines: dict) -> str:
    """One evaluation as a line, after ``what`` (e.g. ``eval step 400``): every metric (an interval's ends in
    brackets after its value), then the BLEU and chrF of each baseline on the same pairs (``baselines``: name ->
    scores) and the verdict against the better of copying and the nearest training pair's target where there
    is one."""
    parts = []
    for name, value in metrics.items():
        if name.endswith(("_low", "_high")):
            continue
        part = f"{name} {value:.4g}"
        if f"{name}_low" in metrics and f"{name}_high" in metrics:
            part += f" [{metrics[f'{name}_low']:.4g}, {metrics[f'{name}_high']:.4g}]"
        parts.append(part)
    line = f"{what}: " + " ".join(parts)
    for name, scores in baselines.items():
        line += f" | {name}: bleu {scores['bleu']:.4g} chrf {scores['chrf']:.4g}"
    verdict = translates(metrics, baselines)
    return line + (f" | {verdict}" if verdict is not None else "")
