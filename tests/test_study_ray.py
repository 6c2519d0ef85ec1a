"""kilolayer study --executor ray, against a real Ray cluster that this module starts on 127.0.0.1 and stops.

The cluster is one head node (`ray start --head --block`, 2 CPUs, every port on loopback) run as a child of
the test in its own process group: teardown stops it by that process's id (SIGTERM, and SIGKILL of its
group if anything is left), never `ray stop`, which stops every Ray on the machine by name.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")

# one torch thread per training process (so float reductions, hence losses, are bit-identical between
# executors); no telemetry; Ray keeps 127.0.0.1 instead of swapping in the machine's network address; Ray's
# token authentication with a token of this test run's own (not ~/.ray/auth_token, whose presence would
# otherwise switch it on for the head but not for a driver given an explicit --address)
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}

TINY = {
    "model": {
        "arch": "encoder_decoder",
        "scheme": "deepnorm",
        "layers": 1,
        "decoder_layers": 1,
        "width": 32,
        "heads": 2,
        "ffn": 64,
        "vocab_size": 13,
        "max_len": 12,
    },
    "objective": {"name": "seq2seq"},
    "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 6, "eval_size": 16}},
    "train": {
        "steps": 4,
        "batch_size": 8,
        "lr": 1e-3,
        "warmup": 2,
        "eval_every": 2,
        "log_every": 1,
        "diagnostics_every": 1,
    },
}


# ---------------------------------------------------------------- the cluster


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def group_pids(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def listening(pids: list[int]) -> list[str]:
    """The addresses on which these processes accept TCP connections (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(f[1].split(":")[0])
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, raw))
    return found


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


class Head:
    def __init__(self, address: str, proc: subprocess.Popen, log: Path):
        self.address, self.proc, self.log = address, proc, log


@pytest.fixture(scope="module")
def ray_head():
    pytest.importorskip("ray", reason="Ray is in the dev extra: pip install -e '.[dev]'")
    tmp = Path(tempfile.mkdtemp(prefix="klray", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    port, client, nm, om, env_agent, grpc, listen, metrics = free_ports(8)
    log = tmp / "head.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [
                str(RAY),
                "start",
                "--head",
                "--block",
                "--node-ip-address",
                "127.0.0.1",
                "--port",
                str(port),
                "--num-cpus",
                "2",
                "--num-gpus",
                "0",
                "--include-dashboard",
                "false",
                "--temp-dir",
                str(tmp),
                "--ray-client-server-port",
                str(client),
                "--node-manager-port",
                str(nm),
                "--object-manager-port",
                str(om),
                "--runtime-env-agent-port",
                str(env_agent),
                "--dashboard-agent-grpc-port",
                str(grpc),
                "--dashboard-agent-listen-port",
                str(listen),
                "--metrics-export-port",
                str(metrics),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=ENV,
            cwd=tmp,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None, f"ray start exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start did not come up in 180 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        assert "Local node IP: 127.0.0.1" in log.read_text()
        yield Head(f"127.0.0.1:{port}", proc, log)
    finally:
        proc.terminate()  # ray start --block stops its own processes on SIGTERM
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of its process group that outlived it
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- helpers


def write_spec(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def small_study(tmp: Path) -> Path:
    """5 points: Post-LN and DeepNorm x 2 seeds, then a fine-tuning point that starts from one of them
    (`after` + `init_from`) and is analysed (smoothness)."""
    return write_spec(
        tmp / "small.yaml",
        {
            "name": "small",
            "groups": [
                {"name": "deepnet", "base": TINY, "grid": {"model.scheme": ["post_ln", "deepnorm"]}, "seeds": [0, 1]},
                {
                    "name": "finetune",
                    "after": "deepnet",
                    "init_from": "deepnet",
                    "base": TINY,
                    "grid": {"model.scheme": ["deepnorm"]},
                    "seeds": [0],
                    "analyses": ["smoothness"],
                },
            ],
            "findings": ["deepnet_postln", "deepnet_update"],
        },
    )


# A process started with SIGINT ignored (a background job of a non-interactive shell: `make test &`, nohup,
# CI runners) passes that on to its children, and Python keeps an inherited SIG_IGN instead of installing
# KeyboardInterrupt: a driver started from such a test run would never see the test's Ctrl-C. Every driver
# and reference run is started through this shim, which puts SIGINT back to its default first.
SIGINT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
STARTED: list[subprocess.Popen] = []  # stopped after each test, whatever its outcome (see stop_leftovers)


def spawn(argv: list, **kw) -> subprocess.Popen:
    """``python argv...`` with SIGINT at its default, in a session of its own (so that teardown can stop it
    and its children by process group), recorded for :func:`stop_leftovers`."""
    kw = {"env": ENV, "cwd": ROOT, "start_new_session": True, **kw}
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_DEFAULT, *map(str, argv)], **kw)
    STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def stop_leftovers():
    """A test that fails half-way must not leave its drivers or reference runs training on: they would load
    the machine (and hold ports) for the tests after it."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 30)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    pass


def study(*args, **kw) -> subprocess.Popen:
    return spawn(["-m", "kilolayer", "study", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def records(run: Path, split: str) -> list[tuple]:
    return [
        (r["step"], r["loss"])
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r["split"] == split
    ]


def verdicts(report: Path) -> str:
    return report.read_text().split("## Verdicts", 1)[1].split("\n## ", 1)[0]


def files_state(root: Path) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- same results as the local executor


@pytest.fixture(scope="module")
def both(ray_head, tmp_path_factory):
    """The small study run by the local executor and by Ray (at the same time: they share nothing)."""
    tmp = tmp_path_factory.mktemp("both")
    spec = small_study(tmp)
    t0 = time.perf_counter()
    local = study(spec, "--out", tmp / "local", "--jobs", "2")
    remote = study(
        spec, "--out", tmp / "ray", "--executor", "ray", "--address", ray_head.address, "--cpus-per-run", "1"
    )
    try:
        r_rc, r_out, r_err = finish(remote)
        l_rc, l_out, l_err = finish(local)
    finally:
        for proc in (local, remote):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert l_rc == 0, l_out + l_err
    assert r_rc == 0, r_out + r_err
    return {
        "spec": spec,
        "local": tmp / "local",
        "ray": tmp / "ray",
        "local_out": l_out,
        "ray_out": r_out,
        "seconds": time.perf_counter() - t0,
    }


@pytest.mark.integration
@pytest.mark.slow
def test_ray_gives_the_same_losses_and_verdicts_as_local(both):
    runs = sorted(p.relative_to(both["local"]) for p in (both["local"] / "runs").glob("*/*"))
    assert len(runs) == 5
    for run in runs:
        a, b = both["local"] / run, both["ray"] / run
        st = json.loads((b / "status.json").read_text())
        assert st["status"] == "completed", (run, st, both["ray_out"])
        assert records(a, "train") and records(a, "train") == records(b, "train"), run  # bit for bit
        assert records(a, "eval") == records(b, "eval"), run
    # the fine-tuning point started from its pre-trained point, and its analysis ran (as a Ray task)
    ft = "runs/finetune/scheme=deepnorm_seed=0"
    cfg = yaml.safe_load((both["ray"] / ft / "config.yaml").read_text())
    assert cfg["train"]["init_from"] == str((both["ray"] / "runs/deepnet/scheme=deepnorm_seed=0").resolve())
    smooth = [
        json.loads((d / ft / "analysis/smoothness/smoothness.json").read_text())["cosine"]
        for d in (both["local"], both["ray"])
    ]
    assert smooth[0] == smooth[1]
    # the same verdicts, with the same numbers, in the report and on the command line
    assert verdicts(both["local"] / "report.md") == verdicts(both["ray"] / "report.md")
    words = [ln for ln in both["local_out"].splitlines() if re.match(r"^ *(held|did not hold|inconclusive):", ln)]
    assert len(words) == 2 and words == [ln for ln in both["ray_out"].splitlines() if ln in words]
    # the driver's progress: counts of points, then a summary
    assert "[study] 5/5 points done, 0 running, 0 queued, 0 failed" in both["ray_out"]
    assert "[study] 5 points: 5 finished (5 trained now), 0 failed" in both["ray_out"]


@pytest.mark.integration
@pytest.mark.slow
def test_rerun_through_ray_trains_nothing(both, ray_head):
    before = files_state(both["ray"] / "runs")
    rc, out, err = finish(study(both["spec"], "--out", both["ray"], "--executor", "ray", "--address", ray_head.address))
    assert rc == 0, err
    assert "(0 trained now)" in out
    assert files_state(both["ray"] / "runs") == before  # no run directory was touched
    assert "0 trained in this invocation" in (both["ray"] / "report.md").read_text()
    assert verdicts(both["ray"] / "report.md") == verdicts(both["local"] / "report.md")


@pytest.mark.integration
def test_head_listens_on_loopback_only(ray_head):
    addrs = listening(group_pids(ray_head.proc.pid))
    assert addrs and all(is_loopback(a) for a in addrs), addrs


# ---------------------------------------------------------------- kilolayer search on the same cluster


@pytest.mark.integration
def test_search_through_ray_gives_the_local_executors_leaderboard(ray_head, tmp_path):
    """kilolayer search --executor ray: a rung's trials train at once on the cluster (2 CPUs, 1 each), and the
    leaderboard read back is the local executor's, trial for trial and bit for bit."""
    pytest.importorskip("optuna")
    from test_search import PARAMS
    from test_search import TINY as SEARCH_TINY

    from kilolayer.config import load_config
    from kilolayer.study import search as S

    def leaderboard(search: S.Search) -> list[tuple]:
        return [(t.number, t.shape.name, t.state, t.step, t.value, t.reason) for t in search.ranked]

    sets = [*SEARCH_TINY, "train.eval_batches=4"]
    cmd = ["-m", "kilolayer", "search", "configs/digits_mae.yaml", "--params", PARAMS, "--depths", "1..3"]
    cmd += ["--tolerance", "0.1", "--forecast-steps", "3", "--keep-forecast-failures", *[f"--set={s}" for s in sets]]
    cmd += ["--executor", "ray", "--address", ray_head.address, "--cpus-per-run", "1", "--out", tmp_path / "ray"]
    driver = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    settings = S.Settings(PARAMS, (1, 3), 0.1, forecast_steps=3, keep_forecast_failures=True)
    local = S.run_search(load_config("configs/digits_mae.yaml", sets), tmp_path / "local", settings, log=print)
    rc, out, err = finish(driver, timeout=400)
    assert rc == 0, out + err
    assert "up to 2 trial(s) at once, each 1 CPU" in out  # a rung's trials train together
    remote = S.run_search(load_config("configs/digits_mae.yaml", sets), tmp_path / "ray", settings, log=print)

    # read back (nothing left to train), it is the local search, trial for trial and bit for bit
    assert [t.state for t in remote.ranked] == ["completed", "pruned", "pruned"]
    assert leaderboard(remote) == leaderboard(local)
    assert [t.curve for t in remote.ranked] == [t.curve for t in local.ranked]
    assert "successive halving, rung 0 (step 3)" in remote.ranked[-1].reason
    assert f"recommended: {local.ranked[0].shape.name}" in out
    assert load_config(remote.best).model == load_config(local.best).model


# ---------------------------------------------------------------- refusals, one line each


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


@pytest.mark.integration
@pytest.mark.skipif(not _unshare_works(), reason="needs a private mount namespace (unshare -m, as root)")
def test_out_not_shared_with_the_workers_is_refused_in_one_line(ray_head, tmp_path):
    """The driver runs in a private mount namespace with a tmpfs over DIR: its --out DIR/study exists for
    it alone, exactly as a directory on a driver's local disk does for the nodes of a cluster. Ray's
    workers (started by the head, outside the namespace) see the empty DIR underneath."""
    private = tmp_path / "private"
    private.mkdir()
    spec = small_study(tmp_path)
    script = (
        'mount -t tmpfs tmpfs "$1" && exec "$2" -m kilolayer study "$3" --out "$1/study" --executor ray --address "$4"'
    )
    p = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            str(private),
            sys.executable,
            str(spec),
            ray_head.address,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(
        f"kilolayer: error: --out {private}/study is not on a shared file system: "
        f"a Ray task on node 127.0.0.1 cannot read "
    ), lines[0]
    assert not any(private.iterdir())  # nothing trained: nothing reached the real directory


def _ray_env_restored(monkeypatch):
    # kilolayer sets these in its own process before importing Ray: put this test process's back afterwards
    for name in ("RAY_USAGE_STATS_ENABLED", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        monkeypatch.delenv(name, raising=False)


def test_executor_ray_without_ray_is_one_line(tmp_path, monkeypatch, capsys):
    from kilolayer.cli import main

    _ray_env_restored(monkeypatch)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when not installed
    spec = small_study(tmp_path)
    rc = main(["study", str(spec), "--out", str(tmp_path / "out"), "--executor", "ray"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == [
        "kilolayer: error: --executor ray: Ray is not installed; install it with pip install 'kilolayer[ray]'"
    ]
    assert not (tmp_path / "out").exists()  # refused before --out (or its study lock) is created


@pytest.mark.integration
@pytest.mark.parametrize(
    "address, needle",
    [
        ("nonsense", "--address nonsense: expected auto or HOST:PORT"),
        ("127.0.0.1:0", "--address 127.0.0.1:0: expected auto or HOST:PORT"),
        ("127.0.0.1:{port}", "--address 127.0.0.1:{port}: nothing accepts connections at 127.0.0.1:{port} ("),
    ],
)
def test_bad_address_is_one_line_within_seconds(tmp_path, monkeypatch, capsys, address, needle):
    """Ray's own connect retries an address where nothing listens for minutes, deaf to Ctrl-C: kilolayer
    refuses it first, in one line, before anything is written."""
    pytest.importorskip("ray")
    from kilolayer.cli import main

    _ray_env_restored(monkeypatch)
    port = free_ports(1)[0]  # nothing listens there
    address, needle = address.format(port=port), needle.format(port=port)
    t0 = time.monotonic()
    rc = main(
        ["study", str(small_study(tmp_path)), "--out", str(tmp_path / "out"), "--executor", "ray", "--address", address]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"kilolayer: error: {needle}"), lines
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_importing_kilolayer_does_not_import_ray():
    code = (
        "import sys, kilolayer, kilolayer.cli, kilolayer.study.cli, kilolayer.study.runner, "
        "kilolayer.study.ray_executor; print('ray' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT)
    assert p.stdout.strip() == "False", p.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--address", "127.0.0.1:1"], "--address: only with --executor ray"),
        (["--gpus-per-run", "1", "--nproc-per-run", "2"], "--gpus-per-run, --nproc-per-run: only with --executor ray"),
        (["--executor", "ray", "--jobs", "2"], "--jobs: only with --executor local"),
        (["--executor", "ray", "--nproc-per-run", "0"], "--nproc-per-run=0: expected an integer >= 1"),
        (["--executor", "ray", "--cpus-per-run", "0.5"], "--cpus-per-run=0.5: expected a number >= 1"),
    ],
)
def test_executor_options_misused_are_one_line(tmp_path, capsys, args, needle):
    from kilolayer.cli import main

    rc = main(["study", str(small_study(tmp_path)), "--out", str(tmp_path / "out"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_train_command_under_torchrun(tmp_path):
    from kilolayer.study.runner import train_command
    from kilolayer.study.spec import expand, load_spec

    point = expand(load_spec(small_study(tmp_path)))[0]
    one, two = train_command(point, tmp_path, 1), train_command(point, tmp_path, 2)
    assert one[1:] == [
        "-m",
        "kilolayer",
        "train",
        str(tmp_path / "configs/deepnet/scheme=post_ln_seed=0.yaml"),
        "--out",
        str(tmp_path / "runs/deepnet/scheme=post_ln_seed=0"),
        "--resume",
        "--quiet",
    ]
    # torchrun is torch.distributed.run; --standalone picks a free rendezvous port per point
    assert two == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        *one[2:],
    ]


# ---------------------------------------------------------------- faults


FAULT = {
    **TINY,
    "train": {
        "steps": 800,
        "batch_size": 8,
        "lr": 1e-3,
        "warmup": 2,
        "eval_every": 200,
        "log_every": 1,
        "checkpoint_every": 50,
    },
}


def last_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(ln)["step"] for ln in lines[-3:-1]), default=0)  # the last line may be cut
    except (OSError, ValueError):
        return 0


def train_pid(run: Path) -> int:
    """The PID of the `kilolayer train` process writing ``run`` (0 if none)."""
    for name in os.listdir("/proc"):
        try:
            args = Path(f"/proc/{name}/cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError):
            continue
        if name.isdigit() and "train" in args and str(run) in args and "kilolayer" in args:
            return int(name)
    return 0


def parent(pid: int) -> tuple[int, str]:
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return ppid, Path(f"/proc/{ppid}/cmdline").read_bytes().decode().replace("\0", " ")


def wait_until(condition, what: str, driver: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if driver.poll() is not None:
            out, err = driver.communicate()
            pytest.fail(f"the driver exited ({driver.returncode}) while waiting for {what}:\n{out}\n{err}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.slow
def test_interrupt_and_killed_workers_resume_to_the_same_losses(ray_head, tmp_path):
    """Two points of one 800-step run are stopped by Ctrl-C on the driver and resumed by re-running the
    command; then one has its `kilolayer train` process and the other its Ray worker killed (SIGKILL)
    mid-run. Ray retries both, and both end with the losses of the same run trained uninterrupted (a plain
    `kilolayer train`, alongside), step for step."""
    groups = ("kill_train", "kill_worker")
    spec = write_spec(
        tmp_path / "fault.yaml", {"name": "fault", "groups": [{"name": g, "base": FAULT} for g in groups]}
    )
    reference = tmp_path / "reference"
    alone = spawn(
        ["-m", "kilolayer", "train", write_spec(tmp_path / "run.yaml", FAULT), "--out", reference, "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = tmp_path / "study"
    runs = {g: out / "runs" / g / "seed=0" for g in groups}
    cmd = (spec, "--out", out, "--executor", "ray", "--address", ray_head.address)

    # 1. Ctrl-C on the driver while both train: the tasks are cancelled, each forwards the interrupt to its
    # training process, which saves a checkpoint and records `interrupted`
    driver = study(*cmd)
    wait_until(lambda: last_step(runs["kill_train"]) > 60 and last_step(runs["kill_worker"]) > 60, "training", driver)
    driver.send_signal(signal.SIGINT)
    rc, _, err = finish(driver, timeout=180)
    assert rc == 130 and err.strip().splitlines()[-1] == "kilolayer: interrupted", err
    stopped = {}
    for g in groups:
        st = json.loads((runs[g] / "status.json").read_text())
        assert st["status"] == "interrupted" and st["last_checkpoint"] == st["step"] > 60, st
        assert train_pid(runs[g]) == 0  # no training process outlived the driver
        stopped[g] = st["step"]

    # 2. the same command resumes them; kill one's training process past its next regular checkpoint, and
    # the other's Ray worker a few steps after it resumed
    past = {"kill_train": stopped["kill_train"] // 50 * 50 + 55, "kill_worker": stopped["kill_worker"] + 15}
    # the points start apart when Ray brings up one worker later (seconds on a busy machine: 155 and 470 steps
    # at the Ctrl-C once): room for that
    assert max(past.values()) < FAULT["train"]["steps"] - 50, (
        stopped,
        "the two ran too far apart to be killed mid-run",
    )
    driver = study(*cmd)
    wait_until(
        lambda: train_pid(runs["kill_train"]) and last_step(runs["kill_train"]) > past["kill_train"],
        "kill_train to train on",
        driver,
    )
    victim = train_pid(runs["kill_train"])
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: train_pid(runs["kill_worker"]) and last_step(runs["kill_worker"]) > past["kill_worker"],
        "kill_worker to train on",
        driver,
    )
    trainer = train_pid(runs["kill_worker"])
    worker, what = parent(trainer)
    assert what.startswith("ray::train_task"), what
    os.kill(worker, signal.SIGKILL)
    rc, out_text, err = finish(driver)
    assert rc == 0, err
    assert "[study] 2 points: 2 finished (2 trained now), 0 failed" in out_text
    assert alone.wait(timeout=600) == 0, alone.stderr.read()

    expected = records(reference, "train")
    assert [s for s, _ in expected] == list(range(1, FAULT["train"]["steps"] + 1))
    for g in groups:
        st = json.loads((runs[g] / "status.json").read_text())
        assert st["status"] == "completed" and st["step"] == FAULT["train"]["steps"], st
        assert records(runs[g], "train") == expected, g  # bit for bit, every step
        assert records(runs[g], "eval") == records(reference, "eval"), g
        # started at 0, resumed from the interrupt's checkpoint, then (Ray's retry) from the newest one
        resumed = [r["step"] for r in json.loads((runs[g] / "resume.json").read_text())]
        assert len(resumed) == 3 and resumed[:2] == [0, stopped[g]], (g, resumed)
        if g == "kill_train":
            assert resumed[2] == (stopped[g] // 50 + 1) * 50, resumed  # the regular checkpoint it passed
        else:
            assert stopped[g] <= resumed[2] < FAULT["train"]["steps"], (
                resumed
            )  # one saved on SIGTERM, or the newest before
    assert json.loads((runs["kill_train"] / "status.json").read_text())["pid"] != victim
    assert json.loads((runs["kill_worker"] / "status.json").read_text())["pid"] != trainer


@pytest.mark.integration
@pytest.mark.slow
def test_ray_trains_a_point_again_when_its_source_moved(ray_head, tmp_path):
    """The Ray executor's own dispatch of ``init_from`` points: a fine-tuning run that started from step 2 of its
    source, which has since been resumed to its chosen checkpoint (step 4), is set aside whole and trained again
    from step 4, as the local runner does (tests/test_study_init_from.py); a further run trains nothing."""
    from test_study_init_from import SPEC, with_train

    from kilolayer import rundir
    from kilolayer.study.spec import StudySpec, expand
    from kilolayer.train.run import train

    spec = write_spec(tmp_path / "spec.yaml", SPEC)
    pre, ft = expand(StudySpec.model_validate(SPEC))
    out = tmp_path / "study"
    src, dep = pre.run_dir(out), ft.run_dir(out)
    train(with_train(pre.config, steps=2), src, quiet=True)  # the source, stopped at step 2
    rundir.write_status(src, "interrupted", 2, "interrupted by SIGTERM at step 2 (checkpoint step 2 saved)")
    train(ft.config, dep, quiet=True, sets=[f"train.init_from={src}"])  # fine-tuned from that step 2
    assert rundir.read_status(dep)["init_from"]["step"] == 2
    cmd = (spec, "--out", out, "--executor", "ray", "--address", ray_head.address)
    rc, so, se = finish(study(*cmd))
    assert rc == 0, so + se
    assert rundir.read_status(src)["step"] == 4
    assert rundir.read_status(dep)["init_from"] == {"path": str(src.resolve()), "step": 4}
    stale = dep.with_name("seed=0.stale-1")
    assert rundir.read_status(stale)["init_from"]["step"] == 2 and (stale / rundir.CHECKPOINTS).is_dir()
    assert "ft/seed=0: training again from scratch: it started from step 2 of pre/seed=0" in so + se
    before = files_state(out / "runs")
    rc, so, se = finish(study(*cmd))
    assert rc == 0, so + se
    assert files_state(out / "runs") == before  # nothing stale any more: nothing trained


@pytest.mark.integration
@pytest.mark.slow
def test_nproc_per_run_trains_under_torchrun_like_torchrun_itself(ray_head, tmp_path):
    """--nproc-per-run 2: the point is a 2-process DDP run (gloo on CPU) inside its Ray task, and gives the
    losses of the same config under a plain `torchrun --nproc-per-node 2`, bit for bit."""
    base = {**TINY, "train": {**TINY["train"], "steps": 6, "eval_every": 3, "diagnostics_every": 0}}
    spec = write_spec(tmp_path / "ddp.yaml", {"name": "ddp", "groups": [{"name": "ddp", "base": base}]})
    ref = tmp_path / "torchrun"
    alone = spawn(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kilolayer", "train"]
        + [write_spec(tmp_path / "run.yaml", base), "--out", ref, "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = tmp_path / "study"
    rc, text, err = finish(
        study(spec, "--out", out, "--executor", "ray", "--address", ray_head.address, "--nproc-per-run", "2")
    )
    assert rc == 0, err
    assert "each 2 CPU, 0 GPU, 2 process(es)" in text  # --cpus-per-run defaults to --nproc-per-run
    assert alone.wait(timeout=600) == 0, alone.stderr.read()
    run = out / "runs" / "ddp" / "seed=0"
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    assert records(run, "train") == records(ref, "train") and len(records(ref, "train")) == 6


@pytest.mark.integration
def test_kilolayer_started_ray_stays_on_loopback(tmp_path):
    """Without --address kilolayer starts Ray itself: on 127.0.0.1, every port on loopback, no telemetry."""
    code = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from test_study_ray import group_pids, listening
from kilolayer.study.executors.cluster import connect, import_ray
ray = import_ray(None)
connect(ray, None)
pids = [p for p in group_pids(os.getpgid(0)) if p != os.getpid()]
print(json.dumps({"node": ray.nodes()[0]["NodeManagerAddress"], "listening": listening(pids + [os.getpid()]),
                  "usage_stats": os.environ.get("RAY_USAGE_STATS_ENABLED")}))
ray.shutdown()
"""
    # Ray's defaults otherwise: it switches on token authentication and writes its token to ~/.ray, here a
    # temporary home; its session files go to a scratch directory (short: socket paths must fit 107 bytes)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    scratch = tempfile.mkdtemp(prefix="klray", dir="/tmp")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
        env={**env, "HOME": str(tmp_path), "RAY_TMPDIR": scratch},
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        assert list(Path(scratch).glob("ray/session_*"))  # the session lived here, not in /tmp/ray
    finally:
        try:  # the Ray it started, by process group, had the script failed or hung before ray.shutdown()
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    assert (tmp_path / ".ray" / "auth_token").is_file()
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["node"] == "127.0.0.1"
    assert got["listening"] and all(is_loopback(a) for a in got["listening"]), got
    assert got["usage_stats"] == "0"
