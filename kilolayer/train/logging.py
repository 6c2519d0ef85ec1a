"""Run outputs: metrics.jsonl (one JSON object per line), TensorBoard events, status.json, progress."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable
    return v


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (flushed per line) and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict) -> None:
        self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        if self.tb is not None:
            split = record.get("split", "train")
            for k, v in record.items():
                if k not in ("step", "split") and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"{split}/{k}", v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """On resume: drop records logged after the checkpoint we resume from (they will be logged again)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if rec.get("step", 0) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def write_status(run_dir: Path, status: str, step: int, reason: str = "", **extra) -> None:
    data = {"status": status, "step": step, "reason": reason, **extra}
    path = Path(run_dir) / "status.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


class Progress:
    """A rich progress bar on a terminal; plain periodic lines otherwise (logs, CI)."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.t0, self.s0 = time.perf_counter(), start
        self.bar = None
        if self.tty:
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            self.bar = RichProgress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                    TextColumn("{task.description}"), TimeRemainingColumn())
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
