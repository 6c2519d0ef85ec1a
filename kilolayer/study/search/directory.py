"""The search's directory: its files' names, the check that a re-run continues the same search, and what the
search has spent outside its trials, read back from what it saved."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import Config
from kilolayer.errors import ConfigError
from kilolayer.study.search.settings import Settings

SETTINGS = "search.json"
PRESCREEN = "prescreen.json"
JOURNAL = "optuna.journal"
LOCK = "search.lock"
TRIALS = "trials"
CHOICE = "choice.json"  # the config files the search wrote (name: sha256), the only ones it replaces
PLAN = "plan.json"  # the trial length --minutes chose, kept for re-runs
STARTS = "starts"  # the pre-screen's replays saved as checkpoints, one folder per trial config (its hash)


def config_key(config: Config) -> str:
    """A trial config's identity: its pre-screen entry's key and the name of its folder under ``starts/``."""
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


def seconds_outside_trials(out: Path, study_attrs: dict) -> float:
    """Seconds the search at ``out`` has spent outside its trials' training: planning (finding the shapes and
    measuring their costs, ``plan.json``), the pre-screen's forecasts (``prescreen.json``) and the rung cuts
    (each decision's ``seconds`` in the study's ``study_attrs``). Each is saved with what it measured, so a
    re-run counts what the runs before it spent."""
    plan = rundir.read_json(out / PLAN, None) or {}
    screens = rundir.read_json(out / PRESCREEN, None) or {}
    cuts = [v for k, v in study_attrs.items() if k.startswith("decision_") and isinstance(v, dict)]
    return (
        float(plan.get("probe_seconds", 0.0))
        + sum(float(e.get("seconds", 0.0)) for e in screens.values() if isinstance(e, dict))
        + sum(float(d.get("seconds", 0.0)) for d in cuts)
    )


def _check_same_search(out: Path, config: Config, settings: Settings, write: bool = True) -> None:
    """``search.json``: written by the first run (``write``); a re-run with other settings is refused (naming
    them)."""
    mine = settings.identity(config)
    saved = rundir.read_json(out / SETTINGS, None) if out.is_dir() else None
    if saved is None:
        if write:
            rundir.write_json(out / SETTINGS, mine)
        return
    if saved != mine:
        from kilolayer.config import differences

        keys = list(differences(saved, mine))
        if keys == ["config.train.precision"] and _same_precision(config, saved["config"]["train"]["precision"]):
            return
        raise ConfigError(
            f"--out {out}: holds a search with other settings ({', '.join(keys[:5])} differ); give the same config "
            f"and options to continue it (only --budget-steps and --minutes may change), or choose another --out"
        )


def _same_precision(config: Config, saved: str) -> bool:
    """Whether a search saved with ``train.precision`` ``saved`` trained at what ``config``'s asks for here (fp32
    and an ``auto`` that decides fp32 on this machine: one search)."""
    from kilolayer.train.run import precision_here

    return precision_here(config, saved) == precision_here(config)


def _check_out(out: Path) -> None:
    """Refuse an --out that is a file, or a non-empty directory that holds no search (nothing is created)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file, not a directory")
    if out.is_dir() and not (out / SETTINGS).is_file() and any(p.name != LOCK for p in out.iterdir()):
        raise ConfigError(f"--out {out}: not empty and holds no search; choose another --out")
