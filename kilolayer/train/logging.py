"""Run outputs: metrics.jsonl (through kilolayer.rundir), TensorBoard events, progress."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from kilolayer import rundir

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
            print(f"step {step}/{self.total} {text} eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
