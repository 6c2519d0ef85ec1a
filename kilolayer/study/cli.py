"""``kilolayer study`` and ``kilolayer search``."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from pathlib import Path

from kilolayer.errors import ConfigError


def cmd_study(args) -> int:

    if args.list:
        from kilolayer.study.builtin import BUILTIN
        from kilolayer.study.spec import expand, load_spec

        pad = max(map(len, BUILTIN))
        for name in BUILTIN:
            spec = load_spec(name)
            if spec.expected_minutes:
                m = spec.expected_minutes
                mins = f"~{m:.0f} min" if m < 120 else f"~{m / 60:.1f} h" if m < 6000 else f"~{m / 60:,.0f} h"
                mins += f" on 2 CPU cores ({spec.expected_basis})" if spec.expected_basis else " on 2 CPU cores"
            else:
                mins = "time not measured (kilolayer study NAME --estimate)"
            first = spec.description.strip().split(". ")[0].rstrip(".")
            print(f"{name:{pad}s} {len(expand(spec)):3d} runs, {mins}\n{'':{pad}s} {first}.")
        return 0
    from kilolayer.study import executors

    if args.estimate and args.executor == "ray":
        raise ConfigError("--estimate times points on this machine; use it without --executor ray")
    executor = executors.from_args(args, "study")
    say_adaptive_threads(executor, "point")
    if args.estimate:
        return _estimate(args, executor.jobs)
    if not args.spec or not args.out:
        raise ConfigError("study: give NAME|SPEC.yaml and --out DIR (or --list, or --estimate)")
    from kilolayer.study.report import write_report
    from kilolayer.study.spec import check_data, expand, load_spec

    spec = load_spec(args.spec, args.set)
    points = expand(spec)  # every point's config and claim checked before --out is touched
    say_claim_notes(spec)
    if executor.name != "ray":  # a cluster's nodes may hold data the driver does not
        check_data(points)
    t0, began = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc)
    with study_lock(Path(args.out)):
        from kilolayer.study import clock
        from kilolayer.study.registered import record_claims

        record_claims(spec, points, Path(args.out))  # before anything trains: a later change is post hoc
        results = _run(spec, args)
        runner = "ray" if executor.name == "ray" else f"{executor.name} --jobs {executor.jobs}"
        clock.record(Path(args.out), began, time.perf_counter() - t0, sum(r.ran for r in results), runner)
    md, html, findings = write_report(spec, results, Path(args.out), time.perf_counter() - t0)
    for f in findings:
        print(f"{f.verdict.verdict:>13s}: {f.title}")
    print(f"report: {html}")
    print(f"        {md}")
    from kilolayer import rundir
    from kilolayer.study.analyses import failed_analyses

    failed = failed_analyses(results, Path(args.out))
    if len(failed) == 1:
        print(
            f"1 analysis of a completed point failed ({failed[0]}); why: {failed[0].why}; "
            "re-running the study runs it again"
        )
    elif failed:
        named = ", ".join(map(str, failed[:3])) + (", ..." if len(failed) > 3 else "")
        where = rundir.analysis_error_file("RUN", "NAME")
        print(
            f"{len(failed)} analyses of completed points failed ({named}); why each failed: {where} of its point's "
            f"run (the first: {failed[0].why}); re-running the study runs them again"
        )
    unfinished = [r for r in results if r.status not in ("completed", "diverged")]
    if unfinished:  # the last line: how many points failed, and where to look
        named = ", ".join(r.point.key for r in unfinished[:3]) + (", ..." if len(unfinished) > 3 else "")
        print(
            f"{len(unfinished)} of {len(results)} points did not finish ({named}); their logs: "
            f"{Path(args.out) / 'logs'}/GROUP/POINT.log (a point that never started says why in its run's "
            "status.json); re-running the study resumes them"
        )
    return 1 if unfinished or failed else 0


def say_adaptive_threads(executor, unit: str) -> None:
    """``--threads auto``, said once: each run's own first line says it, but a study's or search's runs are
    quiet."""
    if executor.threads == "auto":
        print(f"--threads auto: each {unit}'s run follows the machine's load, so its losses are not bit-reproducible")


def say_claim_notes(spec) -> None:
    """Before anything trains: the claims of a named set the spec left out, and those its seeds cannot decide."""
    for line in spec.claims_left_out:
        print(f"left out: {line}")
    for line in spec.claims_undecidable:
        print(f"cannot decide: {line}")


@contextlib.contextmanager
def study_lock(out: Path):
    """One ``kilolayer study`` per --out: an flock on OUT/study.lock, dropped by the kernel with the process.
    A second study on the same directory would find points another one is training and report them half done."""
    import fcntl

    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / "study.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot use this directory ({err.strerror or type(err).__name__})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            who = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(
                f"--out {out}: another kilolayer study (PID {who}) is running on this directory; "
                "wait for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}".encode())
        yield
    finally:
        os.close(fd)


def _run(spec, args):
    from kilolayer.study import executors

    executor, out = executors.from_args(args, "study"), Path(args.out)
    if executor.name == "ray":
        from kilolayer.study.ray_executor import run_study_ray

        return run_study_ray(spec, out, executor)
    from kilolayer.study.runner import run_study

    return run_study(spec, out, jobs=executor.jobs, threads=executor.threads)


def add_executor_options(p, command: str) -> None:
    """The executor options of ``kilolayer study`` and ``kilolayer search`` (read by
    :func:`kilolayer.study.executors.from_args`): ``--executor`` (a name of
    :data:`~kilolayer.study.executors.EXECUTORS`), the local executor's ``--jobs``, each run's ``--threads``
    (``kilolayer train``'s option), and the Ray executor's ``--address``, ``--cpus-per-run``, ``--gpus-per-run``
    and ``--nproc-per-run``."""
    from kilolayer.study.executors import EXECUTORS, UNITS
    from kilolayer.train.cli import add_threads_option

    unit = UNITS[command][0]
    local = {
        "point": "local (default): each point a process on this machine",
        "trial": "local (default): one trial after another in this process",
    }[unit]
    p.add_argument(
        "--executor",
        default="local",
        metavar="|".join(EXECUTORS),
        help=f"{local}; ray: one Ray task per {unit}, on a cluster (pip install 'kilolayer[ray]'); results do "
        "not depend on which at the same --threads",
    )
    p.add_argument(
        "--jobs",
        type=int,
        metavar="K",
        help=f"local: train K {unit}s at once (default 1)"
        + ("" if unit == "point" else "; a search's local trials train one at a time"),
    )
    add_threads_option(p, f"each {unit}'s run")
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="ray: the cluster to join (auto, HOST:PORT); omitted: start Ray on this machine (127.0.0.1)",
    )
    p.add_argument(
        "--cpus-per-run",
        type=float,
        metavar="C",
        help=f"ray: CPUs each {unit} reserves, and its torch threads (default: --nproc-per-run)",
    )
    p.add_argument(
        "--gpus-per-run",
        type=float,
        metavar="G",
        help=f"ray: GPUs each {unit} reserves (default 0); train.device auto then uses CUDA",
    )
    p.add_argument(
        "--nproc-per-run",
        type=int,
        metavar="N",
        help=f"ray: train each {unit} with torchrun --nproc-per-node N on its node (default 1)"
        + ("" if unit == "point" else "; a search's trials train in one process"),
    )


def _estimate(args, jobs: int) -> int:
    import json

    from kilolayer.errors import ConfigError
    from kilolayer.study.estimate import estimate
    from kilolayer.study.spec import load_spec

    if not args.spec:
        raise ConfigError("study --estimate: give NAME|SPEC.yaml")
    if args.probe_steps < 1:
        raise ConfigError(f"--probe-steps={args.probe_steps}: expected an integer >= 1")
    spec = load_spec(args.spec, args.set)
    say_claim_notes(spec)
    t0 = time.perf_counter()
    est = estimate(spec, jobs=jobs, probe_steps=args.probe_steps)
    for name, seconds in est["groups"].items():
        print(f"{name:16s} {seconds / 60:8.1f} min of compute")
    print(
        f"{spec.name}: about {est['wall_seconds'] / 60:.0f} min wall-clock with --jobs {jobs} "
        f"({est['compute_seconds'] / 60:.0f} min of compute, {len(est['points'])} runs, "
        f"{est['threads_per_point']} thread(s) per run); probing took {(time.perf_counter() - t0) / 60:.1f} min"
    )
    if args.out:
        path = Path(args.out) / "estimate.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(est, indent=2) + "\n")
        print(f"estimate: {path}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "study",
        help="run a grid of training runs that tests DeepNet's and Bamboo's claims, and write a report",
        description="Run a study (a built-in NAME or a SPEC.yaml): every grid point is an ordinary `kilolayer train` "
        "run under DIR/runs/; DIR/report.md and DIR/report.html say what each paper claims, what was "
        "measured and a verdict. Re-running skips finished points and resumes failed ones.",
    )
    p.add_argument("spec", nargs="?", metavar="NAME|SPEC.yaml", help="a built-in study (see --list) or a spec file")
    p.add_argument("--out", metavar="DIR", help="the study directory")
    add_executor_options(p, "study")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="key.path=value",
        help="override a config key in every group (after the group's own set; repeatable), e.g. train.steps=60",
    )
    p.add_argument("--list", action="store_true", help="list the built-in studies with their expected run time")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="train nothing: time a few steps of each distinct point here and print how long the study "
        "would take with --jobs K (writes DIR/estimate.json when --out is given)",
    )
    p.add_argument(
        "--probe-steps",
        type=int,
        default=5,
        metavar="N",
        help="with --estimate: timed steps per point, after 2 warm-up steps (default 5)",
    )
    p.set_defaults(func=cmd_study)
    register_search(sub)


def cmd_search(args) -> int:
    from kilolayer.config import load_config
    from kilolayer.nn.budget import parse_count
    from kilolayer.study import executors
    from kilolayer.study.search import Settings, parse_depths, run_search
    from kilolayer.study.search.report import write_report

    settings = Settings(
        params=parse_count(args.params),
        depths=parse_depths(args.depths) if args.depths else None,
        tolerance=args.tolerance,
        metric=args.metric or "",
        lr_factor=args.search_lr,
        trials=args.trials,
        reduction_factor=args.reduction_factor,
        min_steps=args.min_steps,
        keep_forecast_failures=args.keep_forecast_failures,
        forecast_steps=args.forecast_steps,
        budget_steps=args.budget_steps,
        minutes=args.minutes,
    )
    if args.forecast_steps is not None and args.forecast_steps < 1:
        raise ConfigError(f"--forecast-steps {args.forecast_steps}: expected an integer >= 1")
    executor = executors.from_args(args, "search")
    say_adaptive_threads(executor, "trial")
    config = load_config(args.config, args.set)
    search = run_search(config, Path(args.out), settings, executor=executor)
    md, html = write_report(search)
    done = [t for t in search.ranked if t.state == "completed"]
    rc = 0
    incomplete = f" (search incomplete: {search.stopped_by_budget}; a larger budget continues it)"
    incomplete = incomplete if search.stopped_by_budget else ""
    if search.best is not None:
        top = done[0]
        print(
            f"recommended: {top.shape.name} ({settings.metric} {top.value:.4g}, trial {top.number}): {search.best}"
            + incomplete
        )
    elif search.comparison is not None and search.comparison.tied:
        a, b = done[:2]
        print(f"within noise: {a.shape.name} and {b.shape.name} (the report says why; no pick){incomplete}")
    elif not any(sc.kept for sc in search.screens):
        print("the pre-screen dropped every shape: nothing trained, no recommendation (--keep-forecast-failures)")
        rc = 1
    else:
        print(f"no trial completed yet: no recommendation{incomplete}")
    print(f"report: {html}")
    print(f"        {md}")
    failed = failed_trials(search)
    if failed:
        print(failed)
        return 1
    return rc


def failed_trials(search) -> str | None:
    """The search's last line when trials failed (how many, and where), else None."""
    failed = [t for t in search.ranked if t.state == "failed"]
    if not failed:
        return None
    named = ", ".join(str(t.run) for t in failed[:3]) + (", ..." if len(failed) > 3 else "")
    return (
        f"{len(failed)} of {len(search.ranked)} trials failed; their run directories: {named} (each one's reason "
        "is in the report); re-running the search goes on"
    )


def register_search(sub) -> None:
    p = sub.add_parser(
        "search",
        help="search the best depth and width for a config's objective at a parameter budget, and write a report",
        description="From CONFIG (its objective, data and training settings): offer one shape per depth in a "
        "range, at the width, heads and FFN closest to the parameter budget (each with its deviation from it), "
        "drop those the doctor forecasts to diverge (or to stall behind another shape), and race the rest by "
        "successive halving judged synchronously (a rung decided once every trial in the race has reached it); "
        "each trial "
        "is an ordinary run directory under DIR/trials/. Writes DIR/report.md, DIR/report.html and the "
        "recommended config DIR/best.yaml (unless the top two are within noise). Re-running continues the "
        "search. Trials run one at a time in this process, or at once as Ray tasks (--executor ray), with the "
        "same leaderboard. Needs Optuna (pip install 'kilolayer[search]').",
    )
    p.add_argument("config", metavar="CONFIG", help="a YAML config file or a preset name")
    p.add_argument("--params", required=True, metavar="N", help="the parameter budget, e.g. 5M, 350k")
    p.add_argument("--out", required=True, metavar="DIR", help="the search directory")
    p.add_argument(
        "--depths", metavar="A..B", help="the depth range (inclusive; default: half to twice the config's depth)"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.03,
        help="within this share of the budget, keep the config's head size and FFN ratio where possible (default 0.03)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="key.path=value", help="override a config key (repeatable)"
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--minutes",
        type=float,
        metavar="M",
        help="budget: minutes for the pre-screen and the race; the trials' length is planned to spend them",
    )
    budget.add_argument("--budget-steps", type=int, metavar="S", help="budget: optimizer steps over all trials")
    p.add_argument(
        "--metric",
        metavar="NAME",
        help="the evaluation metric to rank by (default train.early_stop_metric; its direction as early stopping's)",
    )
    p.add_argument(
        "--search-lr",
        type=float,
        nargs="?",
        const=3.0,
        metavar="F",
        help="search the learning rate jointly, log-uniform in [lr/F, lr*F] (F default 3)",
    )
    p.add_argument("--trials", type=int, metavar="N", help="with --search-lr: trials (default 2 per shape)")
    p.add_argument(
        "--reduction-factor", type=int, default=3, metavar="ETA", help="successive halving's eta (default 3)"
    )
    p.add_argument(
        "--min-steps",
        type=int,
        metavar="K",
        help="the first rung's step (default train.steps / eta^2, rounded up to an evaluation)",
    )
    p.add_argument(
        "--keep-forecast-failures",
        action="store_true",
        help="race the shapes the doctor forecasts to diverge or stall too",
    )
    p.add_argument(
        "--forecast-steps",
        type=int,
        metavar="K",
        help="steps the pre-screen replays per shape (default: the doctor's, through warm-up + 10)",
    )
    add_executor_options(p, "search")
    p.set_defaults(func=cmd_search)
