"""The run directory: its layout, status, metrics, checkpoints and lock.

Everything that reads or writes a run directory goes through this module, so the
layout is defined once::

    RUN/
      train.lock            the training process's lock (fcntl.flock; its PID and host inside)
      status.json           status: running | completed | diverged | failed | interrupted, step, reason, ...
      config.yaml           the resolved config the run trains with now
      tokenizer.json        a model of text: its data's codec (kilolayer.data.codec; with the tokenizer's
                            own tokenizer.bpe.json or tokenizer/), so that it is used without its data
      resume.json           one entry per --resume: step, time, changed train.* keys (old -> new)
      metrics.jsonl         one JSON object per line: step, split (train | eval | diagnostics), loss, ...
      baselines.json        seq2seq: the scores of predictors that do not translate on the pairs the
                            evaluations decode (kilolayer.objectives.baselines): split, pairs, baselines
      scores_SPLIT.json     kilolayer evaluate: the chosen checkpoint's metrics on all of SPLIT (or its
                            first --samples, with of: the split's size), and the baselines there
      checkpoints/step_NNNNNNNN/
                            one checkpoint (see kilolayer.train.checkpoint); manifest.json holds the
                            SHA-256 of each file, COMPLETE is written last. With early stopping
                            (train.patience > 0) the best one is kept beside the newest: each
                            checkpoint's state.json names the run's best step at that point
      analysis/NAME/NAME.json
                            the result of analysis NAME (a study's analyses, the chance-level cache
                            ``chance``), stamp.json beside it saying what it was measured with
      analysis/NAME/error.txt
                            why a study's last attempt at analysis NAME failed: one line, then the
                            traceback of an exception that is not a kilolayer error; removed when
                            the analysis next succeeds
      tensorboard/, samples/

Readers (analysis, study reports) never take the lock; only one training process
writes a run directory at a time.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import TextIO

from kilolayer.errors import InputError, KilolayerError
from kilolayer.files import write_atomic

CONFIG = "config.yaml"
STATUS = "status.json"
METRICS = "metrics.jsonl"
RESUME = "resume.json"
LOCK = "train.lock"
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
BASELINES = "baselines.json"
ANALYSIS = "analysis"
STAMP = "stamp.json"
ANALYSIS_ERROR = "error.txt"
# the data's codec (kilolayer.data.codec: tokenizer.json and the tokenizer's own file or folder), kept so that
# the trained model reads and writes text without its data
CODEC_FILES = ("tokenizer.json", "tokenizer.bpe.json", "tokenizer")
SCORED_SPLITS = ("validation", "test")  # the splits kilolayer evaluate scores a run on


def scores_name(split: str) -> str:
    """The file ``kilolayer evaluate --split SPLIT`` writes in the run directory."""
    return f"scores_{split}.json"


def analysis_dir(run_dir: str | Path, name: str) -> Path:
    """Where analysis ``name`` of a run keeps its files: ``RUN/analysis/NAME``."""
    return Path(run_dir) / ANALYSIS / name


def analysis_file(run_dir: str | Path, name: str) -> Path:
    """The result of analysis ``name`` of a run: ``RUN/analysis/NAME/NAME.json``."""
    return analysis_dir(run_dir, name) / f"{name}.json"


def analysis_error_file(run_dir: str | Path, name: str) -> Path:
    """Why a study's last attempt at analysis ``name`` of a run failed: ``RUN/analysis/NAME/error.txt``."""
    return analysis_dir(run_dir, name) / ANALYSIS_ERROR


def read_analysis(run_dir: str | Path, name: str) -> dict | None:
    """The saved result of analysis ``name`` of a run; None if there is none, it cannot be read, or the last
    attempt to measure it again failed (its ``error.txt`` stands: the result left from before is out of date)."""
    if analysis_error_file(run_dir, name).exists():
        return None
    data = read_json(analysis_file(run_dir, name))
    return data if isinstance(data, dict) else None


# what a run writes; --overwrite removes exactly these, never anything else in the directory
OWN_ENTRIES = (
    STATUS,
    CONFIG,
    METRICS,
    RESUME,
    BASELINES,
    *map(scores_name, SCORED_SPLITS),
    CHECKPOINTS,
    "tensorboard",
    "samples",
    ANALYSIS,
    *CODEC_FILES,
)

STATUSES = ("running", "completed", "diverged", "failed", "interrupted")
FINISHED = ("completed", "diverged")  # results; failed and interrupted runs are resumed

STEP_DIR = re.compile(r"^step_(\d{8})$")


class RunDirError(KilolayerError):
    """The run directory cannot be used: not a directory, not ours, locked, or an operating-system error."""


class RunLocked(RunDirError):
    """Another training process holds the run directory."""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def os_error(err: BaseException, path: str | Path | None = None) -> RunDirError:
    """One line for an operating-system error: the path and what went wrong (e.g. 'No space left on device')."""
    where = getattr(err, "filename", None) or path
    what = getattr(err, "strerror", None)
    if not what:
        text = str(err).strip()
        what = text.splitlines()[0] if text else err.__class__.__name__
    return RunDirError(f"{where}: {what}" if where else what)


# ---------------------------------------------------------------- what a directory is


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a kilolayer run: a status.json of ours (written first, when training starts),
    or a loadable config.yaml beside metrics.jsonl or checkpoints/ of ours (a run without a status.json)."""
    path = Path(path)
    if not path.is_dir():
        return False
    if read_status(path).get("status") in STATUSES:
        return True
    if not (path / CONFIG).is_file():
        return False
    try:
        from kilolayer.config import load_config

        load_config(path / CONFIG)
    except Exception:  # any file that is not a kilolayer config: not a run of ours
        return False
    ckpts = path / CHECKPOINTS
    if ckpts.is_dir() and any(STEP_DIR.match(p.name) for p in ckpts.iterdir()):
        return True
    try:
        with open(path / METRICS) as fh:
            first = json.loads(fh.readline())
        return isinstance(first, dict) and "step" in first and "split" in first
    except (OSError, ValueError):
        return False


def is_empty(path: str | Path) -> bool:
    """No entries, or only a lock file left by a run that stopped before writing anything."""
    path = Path(path)
    return not path.exists() or all(p.name == LOCK for p in path.iterdir())


def check_out(path: str | Path) -> None:
    """Refuse an --out that is a file, lies under a file, or is a non-empty directory that is not a run.
    Reads only; nothing is created."""
    path = Path(path)
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            where = "is a file" if parent == path else f"lies under the file {parent}"
            raise RunDirError(f"--out {path}: {where}, not a directory")
        if parent.exists():
            break
    if path.is_dir() and not is_empty(path) and not is_run_dir(path):
        raise RunDirError(
            f"--out {path}: not empty and not a kilolayer run directory (no status.json or config.yaml of a run); "
            f"choose an empty or new directory"
        )


def clear_run(path: str | Path) -> None:
    """Remove what a run wrote (``OWN_ENTRIES``), leaving any other file in place (--overwrite)."""
    for name in OWN_ENTRIES:
        p = Path(path) / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def read_json(path: str | Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def write_json(path: str | Path, data: dict) -> None:
    """``data`` as indented JSON, written atomically (NaN and infinities as the strings ``metrics_line`` uses)."""
    write_atomic(Path(path), json.dumps(_cleaned(data), indent=2) + "\n")


def read_baselines(run_dir: str | Path) -> dict:
    """baselines.json as a dict (``split``, ``pairs``, ``baselines``: name -> scores); {} if there is none."""
    data = read_json(Path(run_dir) / BASELINES, {})
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------- status


def read_status(run_dir: str | Path) -> dict:
    """status.json as a dict; {} if there is none or it is unreadable."""
    data = read_json(Path(run_dir) / STATUS, {})
    return data if isinstance(data, dict) else {}


def write_status(run_dir: str | Path, status: str, step: int, reason: str = "", **extra) -> dict:
    """Replace status.json atomically with ``status`` at ``step`` and ``reason`` (plus ``extra`` fields).
    On a full disk (no block for a temporary file), a final status overwrites the old file in place."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r}: expected one of {', '.join(STATUSES)}")
    data = {"status": status, "step": int(step), "reason": " ".join(str(reason).split()), **extra}
    text = json.dumps(data, indent=2) + "\n"
    try:
        write_atomic(Path(run_dir) / STATUS, text)
    except OSError as err:
        if err.errno != errno.ENOSPC or not (Path(run_dir) / STATUS).is_file():
            raise
        with open(Path(run_dir) / STATUS, "r+") as fh:  # reuses the file's own blocks
            fh.write(text)
            fh.truncate()
    return data


def update_status(run_dir: str | Path, **fields) -> dict:
    """Add or change fields of the current status.json (e.g. the study runner's ``seconds``)."""
    data = {**read_status(run_dir), **fields}
    write_atomic(Path(run_dir) / STATUS, json.dumps(data, indent=2) + "\n")
    return data


class Lifecycle:
    """The status of one training process: ``running`` (PID, host, start time), then exactly one of
    ``completed | diverged | failed | interrupted`` with a reason and ``seconds``, the run's time over all its
    attempts (earlier ones as status.json recorded them, this one from set-up's end). Only rank 0 holds one."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.who = {"pid": os.getpid(), "host": socket.gethostname(), "started": now()}
        self.final: str | None = None
        self.fields: dict = {}  # in every status this process writes (e.g. ``init_from``)
        self.t0 = time.perf_counter()
        earlier = read_status(self.run_dir).get("seconds")
        self.earlier = float(earlier) if isinstance(earlier, (int, float)) else 0.0
        if isinstance(earlier, (int, float)):  # the run's earlier attempts, kept while this one runs
            self.fields["seconds"] = earlier

    def running(self, step: int, **extra) -> None:
        write_status(self.run_dir, "running", step, "", **self.who, **self.fields, **extra)

    def finish(self, status: str, step: int, reason: str = "", **extra) -> bool:
        """Record the final status; False if status.json could not be written (e.g. a full disk)."""
        last = latest_checkpoint(self.run_dir)
        if last is not None:
            extra = {"last_checkpoint": checkpoint_step(last), **extra}
        self.final = status
        # its own record of this attempt too: a study driver killed before the attempt ended cannot add it
        fields = {**self.fields, "seconds": self.earlier + time.perf_counter() - self.t0}
        try:
            write_status(self.run_dir, status, step, reason, **self.who, **fields, finished=now(), **extra)
            return True
        except OSError:
            return False


# ---------------------------------------------------------------- metrics


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable
    return v


def _cleaned(data):
    if isinstance(data, dict):
        return {k: _cleaned(v) for k, v in data.items()}
    return _clean(data)


def metrics_line(record: dict) -> str:
    return json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"


def logged_number(value) -> float:
    """A number of a metrics record as a float: the strings ``metrics_line`` writes for NaN and infinities read
    back as those; null or anything else that is not a number (a diverged run's logs) is NaN."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` (``path`` is the run directory or the file). A missing file
    is no records; a cut-off last line (a run killed mid-write, or one still writing) is ignored; any other
    bad line is an error naming its line number."""
    path = Path(path)
    if path.is_dir() or not path.name.endswith(".jsonl"):
        path = path / METRICS
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read ({err.__class__.__name__})") from None
    records = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == last:
                break
            raise InputError(f"{path}:{i + 1}: not a JSON object") from None
        if not isinstance(record, dict) or "step" not in record:
            raise InputError(f"{path}:{i + 1}: expected a JSON object with a 'step'")
        records.append(record)
    return records


def truncate_metrics(run_dir: str | Path, last_step: int) -> None:
    """On resume: drop records logged after the checkpoint we resume from (they will be logged again),
    and any line cut by a crash."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= last_step:
            kept.append(line)
    write_atomic(path, "".join(line + "\n" for line in kept))


class MetricsFile:
    """Appends records to ``metrics.jsonl``, flushed per line."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / METRICS
        self.file = open(self.path, "a")

    def append(self, record: dict) -> None:
        try:
            self.file.write(metrics_line(record))
            self.file.flush()
        except OSError as err:  # e.g. a full disk: the error names this file
            err.filename = err.filename or str(self.path)
            raise

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass  # a full disk: the error was reported where the write failed


# ---------------------------------------------------------------- resume history


def read_resume_history(run_dir: str | Path) -> list[dict]:
    data = read_json(Path(run_dir) / RESUME, [])
    return data if isinstance(data, list) else []


def record_resume(run_dir: str | Path, step: int, changed: dict) -> None:
    """Append ``{"step", "time", "changed": {"train.key": [old, new]}}`` to resume.json."""
    history = read_resume_history(run_dir) + [{"step": int(step), "time": now(), "changed": changed}]
    write_atomic(Path(run_dir) / RESUME, json.dumps(history, indent=2) + "\n")


# ---------------------------------------------------------------- checkpoints


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def checkpoint_step(path: str | Path) -> int:
    return int(STEP_DIR.match(Path(path).name).group(1))


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories (COMPLETE written), oldest first. Not verified: see intact_checkpoint."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def recorded_best(ckpt: str | Path) -> int | None:
    """The best step early stopping had found when checkpoint ``ckpt`` was written (None if none)."""
    state = read_json(Path(ckpt) / "state.json", {})
    best = state.get("trainer", {}).get("best_step") if isinstance(state, dict) else None
    return best if isinstance(best, int) and not isinstance(best, bool) else None


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints and, for early stopping, the best step each of them
    names (so a resume from any of them still has its best); remove the others."""
    found = complete_checkpoints(run_dir)
    kept = found[-keep:] if keep > 0 else []
    needed = {checkpoint_step(p) for p in kept} | {b for p in kept if (b := recorded_best(p)) is not None}
    for old in found:
        if checkpoint_step(old) not in needed:
            shutil.rmtree(old, ignore_errors=True)


def remove_partial(run_dir: str | Path) -> None:
    """Delete leftovers of an interrupted save."""
    root = Path(run_dir) / CHECKPOINTS
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step_") or (STEP_DIR.match(p.name) and not (p / COMPLETE).exists()):
                shutil.rmtree(p, ignore_errors=True)


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt: str | Path) -> None:
    """manifest.json: the size and SHA-256 of every file of a checkpoint being written."""
    ckpt = Path(ckpt)
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(ckpt.iterdir())
        if p.is_file() and p.name not in (MANIFEST, COMPLETE)
    }
    with open(ckpt / MANIFEST, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(ckpt: str | Path) -> str | None:
    """None if every file matches manifest.json, else one line naming the first damaged file.
    A checkpoint without a manifest (written before checksums existed) is accepted unchecked."""
    ckpt = Path(ckpt)
    manifest = ckpt / MANIFEST
    if not manifest.exists():
        return None
    data = read_json(manifest)
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return f"{manifest}: unreadable"
    for name, want in data["files"].items():
        f = ckpt / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            return f"{f}: missing"
        if size != want.get("bytes"):
            return f"{f}: {size} bytes, the manifest says {want.get('bytes')} (truncated or overwritten)"
        if sha256(f) != want.get("sha256"):
            return f"{f}: SHA-256 does not match the manifest (the file is damaged)"
    return None


def say(text: str, stream: TextIO | None = None) -> bool:
    """Print ``text`` as a line on ``stream`` (stdout by default). False when the stream's reader has gone (a
    pipe into ``head`` that exited): the stream then writes to /dev/null (:func:`silence`), so that output never
    fails a run."""
    stream = stream or sys.stdout
    try:
        print(text, file=stream, flush=True)
        return True
    except BrokenPipeError:
        silence(stream)
        return False


def silence(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null, Python's advice for a pipe whose reader has gone: later
    writes, and the interpreter's last flush, then succeed instead of raising (or exiting 120)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # no descriptor (output captured in memory)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def warn(message: str) -> None:
    say(f"kilolayer: warning: {' '.join(message.split())}", sys.stderr)


def intact_checkpoint(run_dir: str | Path, on_damaged=warn) -> Path | None:
    """The newest complete checkpoint whose files match their checksums, or None if there is no complete
    one. Each damaged newer one is reported in one line through ``on_damaged``; if every one is damaged,
    an InputError names the newest's problem."""
    found = complete_checkpoints(run_dir)
    problems = []
    for ckpt in reversed(found):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            for p in problems:
                on_damaged(f"{p}; using the previous checkpoint {ckpt.name}")
            return ckpt
        problems.append(problem)
    if problems:
        more = f" (and {len(problems) - 1} older checkpoints are damaged too)" if len(problems) > 1 else ""
        raise InputError(f"{problems[0]}; no intact checkpoint to fall back to{more}")
    return None


# ---------------------------------------------------------------- the lock


class RunLock:
    """An exclusive ``fcntl.flock`` on RUN/train.lock (or another lock file ``name`` of a directory that one
    ``owner`` command at a time may write, e.g. a search's), held by the process until :meth:`release` or its
    exit. The kernel drops it with the process, so a ``kill -9`` never leaves a stale lock; the file stays behind
    and only says who held it last."""

    def __init__(self, run_dir: str | Path, name: str = LOCK, owner: str = "kilolayer train"):
        self.path = Path(run_dir) / name
        self.owner = owner
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                what = "run directory" if self.path.name == LOCK else "directory"
                raise RunLocked(
                    f"{self.path.parent}: another {self.owner} ({holder(self.path.parent, self.path.name)}) is "
                    f"writing this {what}; wait for it to finish or stop it, or choose another --out"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder(run_dir: str | Path, name: str = LOCK) -> str:
    """'PID 1234 on host' of the process that holds (or last held) the lock file ``name``."""
    try:
        pid, _, host = (Path(run_dir) / name).read_text().strip().partition(" ")
        return f"PID {int(pid)} on {host}" if host else f"PID {int(pid)}"
    except (OSError, ValueError):
        return "PID unknown"


def is_locked(run_dir: str | Path) -> bool:
    """Whether a training process holds the run directory now (a test that takes and drops the lock)."""
    if not (Path(run_dir) / LOCK).exists():
        return False
    try:
        with RunLock(run_dir):
            return False
    except RunLocked:
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- the checkpoint and evaluation that stand for a run


def chosen_checkpoint(run_dir: str | Path, patience: int = 0, on_damaged=warn) -> Path | None:
    """The checkpoint that stands for the run: its newest intact one, or, when the run trains with early
    stopping (``patience`` > 0), the best step that one names, if that is intact too (else the newest, with a
    line through ``on_damaged``). None if there is no complete checkpoint."""
    newest = intact_checkpoint(run_dir, on_damaged)
    if newest is None or not patience:
        return newest
    best = recorded_best(newest)
    if best is None or best == checkpoint_step(newest):
        return newest
    path = checkpoint_dir(run_dir, best)
    problem = verify_checkpoint(path) if (path / COMPLETE).is_file() else f"{path}: missing"
    if problem is not None:
        on_damaged(f"{problem}; the best checkpoint is unusable, using the newest {newest.name}")
        return newest
    return path


def run_patience(run_dir: str | Path) -> int:
    """``train.patience`` of the run's config.yaml (the config it trains with now); 0 if it cannot be read."""
    from kilolayer.config import load_config

    try:
        return load_config(Path(run_dir) / CONFIG).train.patience
    except (KilolayerError, OSError):
        return 0


def chosen_eval(run_dir: str | Path, evals: list[dict], on_damaged=warn) -> dict:
    """The evaluation record that stands for a completed run: the one of ``evals`` (its ``split: eval``
    records) at the step of :func:`chosen_checkpoint` under the run's own ``train.patience``, so that the
    reported metrics are those of the weights that analyses and ``train.init_from`` load (with early stopping
    the best step, whether the run stopped early or at its step budget). The last record if no checkpoint
    can be chosen or none was evaluated at its step; {} without evaluations."""
    last = evals[-1] if evals else {}
    try:
        ckpt = chosen_checkpoint(run_dir, run_patience(run_dir), on_damaged)
    except KilolayerError:  # every checkpoint damaged (said when the run is loaded)
        return last
    if ckpt is None:
        return last
    step = checkpoint_step(ckpt)
    return next((e for e in reversed(evals) if e.get("step") == step), last)


def recorded_init_from(run_dir: str | Path) -> dict | None:
    """``{"path", "step"}``: the run directory and checkpoint step a run trained with ``train.init_from``
    started from, as its status.json records it (else its newest complete checkpoint's trainer state); None
    if neither records one."""
    found = read_status(run_dir).get("init_from")
    if not isinstance(found, dict):
        newest = latest_checkpoint(run_dir)
        state = read_json(newest / "state.json", {}) if newest is not None else {}
        trainer = state.get("trainer") if isinstance(state, dict) else None
        found = trainer.get("init_from") if isinstance(trainer, dict) else None
    if isinstance(found, dict) and isinstance(found.get("step"), int) and not isinstance(found["step"], bool):
        return found
    return None


# ---------------------------------------------------------------- one run, as its readers see it


class RunDir:
    """One run directory as the code that reads runs sees it (a study's executors, its report and findings):
    its status, the checkpoint and evaluation that stand for it, where it started from. Every property reads
    the files again. Its two writes take the run's lock and leave a run that a training process holds alone
    (that process's status is its own). The training process itself writes through :class:`Lifecycle`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def status(self) -> dict:
        """status.json as a dict; {} if there is none or it is unreadable."""
        return read_status(self.path)

    @property
    def state(self) -> str | None:
        """running | completed | diverged | failed | interrupted; None before any status is written."""
        return self.status.get("status")

    @property
    def finished(self) -> bool:
        """Completed or diverged: a result (failed and interrupted runs are resumed)."""
        return self.state in FINISHED

    @property
    def step(self) -> int:
        return int(self.status.get("step", 0))

    @property
    def seconds(self) -> float:
        """Training time over all attempts, as a study records it (0 if none is recorded)."""
        return float(self.status.get("seconds", 0.0))

    @property
    def status_time(self) -> float:
        """When status.json was last written (seconds since the epoch; 0 if there is none)."""
        try:
            return (self.path / STATUS).stat().st_mtime
        except OSError:
            return 0.0

    @property
    def locked(self) -> bool:
        """Whether a training process holds the run now."""
        return is_locked(self.path)

    @property
    def init_from(self) -> dict | None:
        """``{"path", "step"}`` the run started from with ``train.init_from`` (:func:`recorded_init_from`)."""
        return recorded_init_from(self.path)

    def metrics(self) -> list[dict]:
        """Every record of metrics.jsonl (:func:`read_metrics`)."""
        return read_metrics(self.path)

    def checkpoint(self, on_damaged=warn) -> Path | None:
        """The checkpoint that stands for the run (:func:`chosen_checkpoint` under the run's own
        ``train.patience``); None without a complete one."""
        return chosen_checkpoint(self.path, run_patience(self.path), on_damaged)

    def final_eval(self, evals: list[dict], on_damaged=warn) -> dict:
        """The record of ``evals`` (the run's ``split: eval`` records) that stands for it (:func:`chosen_eval`)."""
        return chosen_eval(self.path, evals, on_damaged)

    def mark_failed(self, reason: str, keep: tuple[str, ...] = FINISHED) -> bool:
        """Record ``failed`` with ``reason`` at the run's step (making the directory if there is none), unless
        its status is one of ``keep`` (by default a finished run's result stands) or a training process holds
        the run. True if it was written."""
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            with RunLock(self.path):
                if self.state in keep:
                    return False
                write_status(self.path, "failed", self.step, reason)
                return True
        except RunLocked:
            return False

    def record_seconds(self, total: float) -> bool:
        """Record ``total``, the run's training time over all its attempts, as status.json ``seconds`` (a
        training process carries the field into every status it writes), unless a training process holds the
        run. True if it was written."""
        try:
            with RunLock(self.path):
                update_status(self.path, seconds=total)
                return True
        except RunLocked:
            return False
