"""``kilolayer doctor``: why a run stalled, diverged or trained, and a forecast before training.

* :func:`diagnose` (``kilolayer doctor RUN_DIR``): one line per problem, with its evidence and a fix;
* :func:`forecast` (``kilolayer doctor CONFIG --forecast``): replay the first steps in memory and
  forecast trains / stalls / diverges by a stated rule;
* :func:`outcome`: what became of a finished run, by one stated rule.
"""

from kilolayer.doctor.diagnose import Diagnosis, Finding, diagnose
from kilolayer.doctor.outcome import Outcome, outcome

__all__ = ["Diagnosis", "Finding", "diagnose", "Outcome", "outcome", "forecast", "Forecast"]


def __getattr__(name):
    if name in ("forecast", "Forecast"):
        from kilolayer.doctor import forecast as module

        return getattr(module, name)
    raise AttributeError(name)
