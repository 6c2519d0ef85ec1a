"""The search's Optuna study on its journal file: the trials, their shape and lr, the evaluations each reported
and their states."""

from __future__ import annotations

from pathlib import Path

from kilolayer.config import Config
from kilolayer.errors import ConfigError
from kilolayer.study.search.directory import JOURNAL
from kilolayer.study.search.settings import Settings


def _import_optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            "kilolayer search needs Optuna (its successive-halving pruner races the trials): "
            "pip install 'kilolayer[search]'"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _open_study(optuna, out: Path, config: Config, settings: Settings, rung: int, dirn: str):
    """The search's Optuna study on its journal file. Optuna keeps the trials (their shape and lr, drawn by its
    TPE sampler, the evaluations each reported, their states); the race itself is decided by
    :meth:`_Racer.judge` (synchronous successive halving), so the study has no pruner of its own."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(out / JOURNAL)))
    return optuna.create_study(
        study_name="search",
        storage=storage,
        load_if_exists=True,
        direction=dirn,
        sampler=optuna.samplers.TPESampler(seed=config.train.seed),
        pruner=optuna.pruners.NopPruner(),
    )


def _enqueue(study, kept: list[str], lr: float | None) -> None:
    """One trial per shape first (at the config's lr), once per search."""
    if study.user_attrs.get("enqueued"):
        return
    for name in kept:
        study.enqueue_trial({"shape": name, **({"lr": lr} if lr is not None else {})}, skip_if_exists=True)
    study.set_user_attr("enqueued", True)
