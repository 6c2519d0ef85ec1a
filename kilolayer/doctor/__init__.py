"""``kilolayer doctor``: why a run stalled, diverged or trained, and a forecast before training.

* :func:`diagnose` (``kilolayer doctor RUN_DIR``): one line per problem, with its evidence and a fix;
* :func:`forecast` (``kilolayer doctor CONFIG --forecast``): replay the first steps in memory and
  forecast trains / stalls / diverges by a stated rule;
* :func:`outcome`: what became of a finished run, by one stated rule.
"""

from kilolayer.doctor.diagnose import Diagnosis, Problem, diagnose
from kilolayer.doctor.forecast import Forecast, forecast
from kilolayer.doctor.outcome import Outcome, outcome

__all__ = ["Diagnosis", "Problem", "diagnose", "Forecast", "forecast", "Outcome", "outcome"]
