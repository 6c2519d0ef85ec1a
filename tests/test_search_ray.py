"""kilolayer search --executor ray: the same leaderboard as the local executor, with trials at once on a Ray
that the search itself starts on 127.0.0.1 (2 CPUs) and shuts down."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("optuna")
pytest.importorskip("ray", reason="Ray is in the dev extra: pip install -e '.[dev]'")

from helpers import ROOT
from test_search import PARAMS, TINY

from kilolayer.config import load_config
from kilolayer.study import search as S


def leaderboard(search: S.Search) -> list[tuple]:
    return [(t.number, t.shape.name, t.state, t.step, t.value, t.reason) for t in search.ranked]


@pytest.mark.integration
def test_ray_gives_the_local_executors_leaderboard(tmp_path):
    sets = [*TINY, "train.eval_batches=4"]
    settings = S.Settings(PARAMS, (1, 3), 0.1, forecast_steps=3, keep_forecast_failures=True)
    local = S.run_search(load_config("configs/digits_mae.yaml", sets), tmp_path / "local", settings, log=print)

    # Ray's own defaults otherwise: token authentication with its token in ~/.ray (here a scratch home), and its
    # session files in /tmp/ray (here a short scratch directory: socket paths must fit 107 bytes)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    scratch = tempfile.mkdtemp(prefix="klray", dir="/tmp")
    env.update(HOME=str(tmp_path), RAY_TMPDIR=scratch, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "kilolayer", "search", "configs/digits_mae.yaml", "--params", str(PARAMS)]
    cmd += ["--depths", "1..3", "--tolerance", "0.1", "--forecast-steps", "3", "--keep-forecast-failures"]
    cmd += [*[f"--set={s}" for s in sets], "--executor", "ray", "--cpus-per-run", "1", "--out", str(tmp_path / "ray")]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        try:  # the Ray it started, by process group, had it failed or hung before shutting Ray down
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    assert proc.returncode == 0, out + err
    assert "up to 2 trial(s) at once, each 1 CPU" in out  # a rung's trials train together
    remote = S.run_search(load_config("configs/digits_mae.yaml", sets), tmp_path / "ray", settings, log=print)

    # read back (nothing left to train), it is the local search, trial for trial and bit for bit
    assert [t.state for t in remote.ranked] == ["completed", "pruned", "pruned"]
    assert leaderboard(remote) == leaderboard(local)
    assert [t.curve for t in remote.ranked] == [t.curve for t in local.ranked]
    assert "successive halving, rung 0 (step 3)" in remote.ranked[-1].reason
    assert f"recommended: {local.ranked[0].shape.name}" in out
    assert load_config(remote.best).model == load_config(local.best).model
