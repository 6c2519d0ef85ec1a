"""The analyses a study group runs on each finished point (``analyses: [NAME]`` in a spec).

An analysis is ``fn(run_dir, target[, data=...])`` that writes ``target/NAME.json`` for one completed run,
registered in :data:`ANALYSES`; a spec's validation reads the registry. Each saved result carries a stamp of
what it was measured with (:func:`analysis_stamp`), so a result from another version of the measurement, other
inputs or another checkpoint is measured again. An analysis that fails for a run leaves why in
``RUN/analysis/NAME/error.txt`` (:func:`record_failure`).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from kilolayer import rundir
from kilolayer.errors import KilolayerError
from kilolayer.files import write_atomic
from kilolayer.registry import Registry
from kilolayer.rundir import STAMP, RunDir

ANALYSES: Registry[Callable[[Path, Path], None]] = Registry("analyses", "analysis")


@ANALYSES.register("smoothness")
def smoothness_analysis(run_dir: Path, target: Path, data: dict | None = None) -> None:
    """Over-smoothing curves on the run's own validation data, or on ``data`` (a data section: the group's
    ``analysis_data``, so that every group of a modality is measured on the same inputs), through the stack's
    observer (as ``kilolayer analyze --run``). The curves only: the report draws the study's figures, and
    ``kilolayer analyze smoothness --compare TARGET/smoothness.json --out DIR`` one run's."""
    from kilolayer.analysis.smoothness import smoothness_of_run, write_smoothness

    write_smoothness(smoothness_of_run(run_dir, data=data, samples=256), target)


@ANALYSES.register("test_scores")
def test_scores_analysis(run_dir: Path, target: Path, data: dict | None = None) -> None:
    """The run scored on its data's ``test`` split, every sample (every pair decoded for seq2seq, with the
    baselines on the same pairs): ``kilolayer evaluate RUN --split test``, kept with the point's analyses for
    the study's final table."""
    from kilolayer.train.score import score_run

    record = score_run(run_dir, "test")
    target.mkdir(parents=True, exist_ok=True)
    write_atomic(rundir.analysis_file(run_dir, "test_scores"), json.dumps(record, indent=1) + "\n")


def _smoothness_version() -> int:
    from kilolayer.analysis.smoothness import SMOOTHNESS_METHOD

    return SMOOTHNESS_METHOD


smoothness_analysis.version = _smoothness_version


def _measured_step(run_dir: Path) -> int | None:
    """The step of the checkpoint that stands for the run (what an analysis loads); None without one."""
    try:
        chosen = RunDir(run_dir).checkpoint(on_damaged=lambda _: None)
    except KilolayerError:
        return None
    return rundir.checkpoint_step(chosen) if chosen is not None else None


def analysis_stamp(name: str, data: dict | None = None, run_dir: Path | None = None) -> dict:
    """What a saved result of analysis ``name`` was measured with: the analysis's version (a ``version``
    callable or int on its function; 1 without), its data section and the step of the run's checkpoint it
    measured (a run resumed to more steps is measured again). A result with another stamp is redone."""
    version = getattr(ANALYSES.get(name), "version", 1)
    step = _measured_step(Path(run_dir)) if run_dir is not None else None
    return {"analysis": name, "version": version() if callable(version) else version, "data": data, "step": step}


def run_analysis(name: str, run_dir: Path, data: dict | None = None) -> Path:
    """Run analysis ``name`` (registered in :data:`ANALYSES`) on a finished run, on ``data`` if given (else the
    run's own); results go to run_dir/analysis/name, with the stamp of :func:`analysis_stamp`, and the reason of
    an earlier failure there is removed."""
    target = rundir.analysis_dir(run_dir, name)
    fn = ANALYSES.get(name)
    fn(run_dir, target) if data is None else fn(run_dir, target, data=data)
    write_atomic(target / STAMP, json.dumps(analysis_stamp(name, data, run_dir)) + "\n")
    rundir.analysis_error_file(run_dir, name).unlink(missing_ok=True)
    return target


def record_failure(name: str, run_dir: Path, err: BaseException | str) -> str:
    """Write why analysis ``name`` of a run failed to ``RUN/analysis/NAME/error.txt`` and return its first line:
    a kilolayer error's message, any other exception's type and message followed in the file by its traceback
    (a bug in the analysis, to be read there), or ``err`` itself when it is a line of text."""
    if isinstance(err, str):
        line, detail = err, ""
    elif isinstance(err, KilolayerError):
        line, detail = str(err), ""
    else:
        line = f"{type(err).__name__}: {err}" if str(err).strip() else type(err).__name__
        detail = "".join(traceback.format_exception(err))
    line = " ".join(line.split())
    path = rundir.analysis_error_file(run_dir, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, line + "\n" + (f"\n{detail}" if detail else ""))
    except OSError as os_err:
        return f"{line} ({path} not written: {os_err.strerror or type(os_err).__name__})"
    return line


def analysis_current(name: str, run_dir: Path, data: dict | None = None) -> bool:
    """Whether ``run_dir`` holds a result of analysis ``name`` measured as it would be now (the same stamp)."""
    saved = rundir.read_json(rundir.analysis_dir(run_dir, name) / STAMP, None)
    return rundir.analysis_file(run_dir, name).exists() and saved == analysis_stamp(name, data, run_dir)


class FailedAnalysis(NamedTuple):
    """An analysis of a completed point without a current result after the study ran it."""

    name: str
    point: str  # GROUP/POINT
    why: Path  # the file :func:`record_failure` wrote

    def __str__(self) -> str:
        return f"{self.name} of {self.point}"


def failed_analyses(results, out: Path) -> list[FailedAnalysis]:
    """Each analysis of a completed point (``results``: the study's, read back after its analyses ran) without a
    current result on disk: it failed, and the study wrote why beside it (:func:`record_failure`)."""
    return [
        FailedAnalysis(name, r.point.key, rundir.analysis_error_file(r.point.run_dir(out), name))
        for r in results
        if r.status == "completed"
        for name in r.point.analyses
        if not analysis_current(name, r.point.run_dir(out), r.point.analysis_data)
    ]
