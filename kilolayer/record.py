"""The run record: one object that every reader of a finished or stopped run uses (the study's findings and report,
the doctor, the search), so that each fact about a run is decided once and the readers differ only in how they word
it.

A record holds the run's status, its evaluations, the evaluation and checkpoint that stand for it (with early stopping,
the best step's), its analyses by name, and the chance level of its evaluation data (cached in the run directory with
the method that computed it: :func:`kilolayer.analysis.chance.chance_of_run`). From these it decides, by one rule
each: whether the run learned (:func:`kilolayer.analysis.chance.learned_something` on its standing evaluation loss),
whether it failed (diverged, or learned nothing), the doctor's outcome (trains | stalls | diverges) and how much it
was still improving at its budget. The files are :mod:`kilolayer.rundir`'s; a run's weights load through
:func:`kilolayer.train.checkpoint.load_run_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from kilolayer.analysis.chance import chance_of_run, learned_something
from kilolayer.config import Config, load_config
from kilolayer.errors import KilolayerError
from kilolayer.rundir import CONFIG, RunDir, checkpoint_step, logged_number, read_analysis

OUTCOMES = ("trains", "stalls", "diverges")


def run_chance(run_dir: str | Path | None, config: Config, write: bool = True, compute=chance_of_run) -> dict:
    """The chance level of ``config``'s evaluation data, through the run's cache in ``run_dir`` when there is one
    (``compute``: :func:`kilolayer.analysis.chance.chance_of_run`; ``write=False`` never writes into the run);
    ``{"loss": nan}`` for an objective of the user's that defines none."""
    try:
        return compute(run_dir, config, write=write)
    except NotImplementedError:
        return {"loss": math.nan}


def _quiet(message: str) -> None:
    """A damaged checkpoint is said where the run's weights are loaded, not again by its readers."""


def _precision(status: dict, run_dir: Path) -> dict:
    """``precision`` and ``precision_reason`` of a run: as its status.json records them, else (a run that recorded
    none) the fp32 or bf16 its config.yaml names."""
    if status.get("precision") in ("fp32", "bf16"):
        return {"precision": status["precision"], "precision_reason": str(status.get("precision_reason", ""))}
    try:
        named = load_config(Path(run_dir) / CONFIG).train.precision
    except KilolayerError:
        return {}
    return {"precision": named, "precision_reason": "train.precision"} if named in ("fp32", "bf16") else {}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(kw_only=True)
class RunRecord:
    """One run as its readers see it, read by :meth:`read` (or made up in memory by a test)."""

    status: str = "missing"  # status.json's (missing: none; unreadable: a damaged metrics.jsonl)
    reason: str = ""
    step: int = 0
    eval: dict = field(default_factory=dict)  # the evaluation that stands for the run (the last one if unfinished)
    evals: list = field(default_factory=list)  # every ``split: eval`` record, in order
    train_losses: list = field(default_factory=list)  # (step, loss) of every training record
    diagnostics: list = field(default_factory=list)  # its ``split: diagnostics`` records
    smoothness: dict | None = None  # its smoothness analysis, when it has one
    test: dict | None = None  # its test split scored whole (the test_scores analysis), when it has been
    seconds: float = 0.0  # training time over all its attempts, as a study records it
    precision: str = ""  # what its steps ran at (fp32 | bf16; "" where nothing says) and why
    precision_reason: str = ""
    chance: dict | None = None  # the chance level of its evaluation data, once read (:meth:`chance_level`)
    path: Path | None = None  # its run directory (None: made up in memory)
    config: Config | None = None  # the config it is judged by (None: its config.yaml)
    read_only: bool = False  # never write into the run directory (the doctor's way: it only reads runs)

    @classmethod
    def read(
        cls,
        run_dir: str | Path,
        config: Config | None = None,
        read_only: bool = False,
        records: list[dict] | None = None,
        **fields,
    ):
        """The record of the run in ``run_dir`` (``records``: its metrics.jsonl, if the caller has read it). A
        damaged metrics.jsonl makes the record ``unreadable`` with the error as its reason, never an exception: one
        damaged run must not cost the readers of the others."""
        run = RunDir(run_dir)
        st = run.status
        status, reason = st.get("status", "missing"), st.get("reason", "")
        if records is None:
            try:
                records = run.metrics()
            except KilolayerError as err:
                records, status, reason = [], "unreadable", str(err)
        evals = [r for r in records if r.get("split") == "eval"]
        # with early stopping the best step's evaluation, whether the run stopped early or at its step budget: the
        # weights that analyses and init_from load
        standing = run.final_eval(evals, on_damaged=_quiet) if status == "completed" else (evals[-1] if evals else {})
        return cls(
            status=status,
            reason=reason,
            step=int(st.get("step", 0)),
            eval=standing,
            evals=evals,
            train_losses=[(r["step"], r["loss"]) for r in records if r.get("split") == "train"],
            diagnostics=[r for r in records if r.get("split") == "diagnostics"],
            smoothness=read_analysis(run.path, "smoothness"),
            test=read_analysis(run.path, "test_scores"),
            seconds=float(st.get("seconds", 0.0)),
            **_precision(st, run.path),
            path=run.path,
            config=config,
            read_only=read_only,
            **fields,
        )

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"

    @property
    def judged(self) -> bool:
        """Completed with a standing evaluation loss: a run judged against its chance level."""
        return self.status == "completed" and "loss" in self.eval

    # ---------------------------------------------------------------- what stands for it

    def checkpoint(self) -> Path | None:
        """The checkpoint that stands for the run (:meth:`kilolayer.rundir.RunDir.checkpoint`); None without one."""
        return RunDir(self.path).checkpoint(on_damaged=_quiet) if self.path is not None else None

    def checkpoint_step(self) -> int | None:
        """The step of :meth:`checkpoint`: the step its weights were trained to."""
        found = self.checkpoint()
        return checkpoint_step(found) if found is not None else None

    def analysis(self, name: str) -> dict | None:
        """The saved result of analysis ``name`` (RUN/analysis/NAME/NAME.json); None without one."""
        return read_analysis(self.path, name) if self.path is not None else None

    @property
    def eval_loss(self) -> float:
        """The standing evaluation's loss; NaN without one (a non-finite logged loss reads as itself)."""
        return logged_number(self.eval.get("loss")) if "loss" in self.eval else math.nan

    # ---------------------------------------------------------------- judged against chance

    def chance_level(self, compute=chance_of_run) -> dict:
        """The chance level of the run's evaluation data (:func:`run_chance` of its config, through its cache),
        read once and kept on the record; ``{"loss": nan}`` for an objective that defines none."""
        if self.chance is None:
            config = self.config
            if config is None:
                config = self.config = load_config(self.path / CONFIG)
            self.chance = run_chance(self.path, config, write=not self.read_only, compute=compute)
        return self.chance

    def learned(self) -> bool | None:
        """Whether the run learned: completed, with a standing evaluation loss at most LEARNED_NOTHING x its chance
        loss (:func:`kilolayer.analysis.chance.learned_something`). A diverged, unfinished or unevaluated run did
        not; None when its data has no chance level (nobody can say)."""
        if not self.judged:
            return False
        return learned_something(self.eval_loss, self.chance_level().get("loss"))

    def failed(self) -> bool | None:
        """Whether the run failed to train: diverged, or completed having learned nothing. None when its data has
        no chance level; False for a run that is not a result (failed, interrupted, missing, never evaluated)."""
        if self.diverged:
            return True
        if not self.judged:
            return False
        got = self.learned()
        return None if got is None else not got

    def outcome(self) -> str | None:
        """The doctor's word for :meth:`failed` and :meth:`learned`: ``diverges``, ``stalls`` (learned nothing),
        ``trains``; None for a run that is no result or whose data has no chance level."""
        if self.diverged:
            return "diverges"
        if not self.judged:
            return None
        got = self.learned()
        return None if got is None else "trains" if got else "stalls"

    # ---------------------------------------------------------------- converged?

    def improvement(self, key: str, lower_is_better: bool = False, relative: bool = False) -> float:
        """How much the run was still improving ``key`` at the end of its training, by the larger of two signs
        (0 when neither shows a gain; a fraction of the earlier value if ``relative``):

        * over the last quarter of its steps: the best of its evaluations in that quarter against the best of as
          many evaluations just before it (one against one when the quarter holds one evaluation) — windows of
          equal size, so a single noisy evaluation at either end neither flags a flat run nor hides a gain;
        * after the evaluation that stands for it (its best checkpoint under early stopping): a later evaluation
          against the standing one, so what the run reports is below what it went on to reach."""
        evs = [e for e in self.evals if _finite(e.get(key))]
        if len(evs) < 2:
            return 0.0
        pick = min if lower_is_better else max

        def gain(new: float, old: float) -> float:
            g = old - new if lower_is_better else new - old
            return g / abs(old) if relative and old else g

        last = evs[-1]["step"]
        later = [float(e[key]) for e in evs if e["step"] > 0.75 * last]
        earlier = [float(e[key]) for e in evs if e["step"] <= 0.75 * last][-len(later) :] or [float(evs[0][key])]
        best = gain(pick(later), pick(earlier))
        standing = self.eval if isinstance(self.eval, dict) else {}
        if _finite(standing.get(key)) and "step" in standing:
            after = [float(e[key]) for e in evs if e["step"] > standing["step"]]
            if after:
                best = max(best, gain(pick(after), float(standing[key])))
        return max(best, 0.0)

    def still_improving(self, key: str, tol: float, lower_is_better: bool = False, relative: bool = False) -> bool:
        """Whether :meth:`improvement` exceeds ``tol``: the run had not converged in ``key`` at its budget."""
        return self.improvement(key, lower_is_better, relative) > tol
