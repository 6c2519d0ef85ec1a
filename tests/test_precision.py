"""``train.precision: auto``: decided from a constructed CPU probe and step ratio (no bf16 instructions: fp32 and
why; bf16 instructions and a step enough faster in bf16: bf16; else fp32), cached per machine and step; recorded in
status.json and the checkpoints and reused by a resume whatever the probe says then (bit-exact); an explicit fp32
never overridden; the built-in studies and the search asking for auto while a study directory and a search
trained at fp32 on a CPU without bf16 keep their points; the report's and the doctor's precision."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from objective_helpers import tiny_lm

from kilolayer import rundir
from kilolayer.config import dump_yaml, load_config
from kilolayer.errors import ConfigError
from kilolayer.train import engine as E
from kilolayer.train.host import precision as P
from kilolayer.train.run import recorded_precision, train

NO_BF16 = "auto: this CPU has no bf16 instructions (avx2)"


def cpu(monkeypatch, tmp_path: Path, bf16: bool, ratio=None) -> list[int]:
    """This CPU as the probe sees it: bf16 instructions or AVX2 only, and a training step ``ratio`` x as fast in bf16
    (a number, or a function of the width; None: measuring fails the test). Returns the widths measured. The cache
    is the test's own."""
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(P, "cpu_bf16", lambda: (True, "avx512_bf16") if bf16 else (False, "avx2"))
    monkeypatch.setattr(P, "load_per_cpu", lambda: 0.1)  # a quiet machine, whatever else runs beside the test
    measured: list[int] = []

    def speedup(config) -> float:
        assert ratio is not None, "auto measured a step where it needs none"
        assert (config.model.scheme, config.train.compile, config.train.hold_heap) == ("pre_ln", False, False)
        measured.append(config.model.width)
        return ratio(config.model.width) if callable(ratio) else ratio

    monkeypatch.setattr(E, "step_speedup", speedup)
    return measured


def shaped(width: int, batch: int = 8, **model):
    """A config of a decoder of ``width`` (64 tokens) trained at auto on micro-batches of ``batch``."""
    m = {"arch": "decoder", "layers": 2, "width": width, "heads": 2, "ffn": 2 * width, "max_len": 64, "vocab_size": 262}
    m.update(model)
    text = {"name": "stdlib_bytes", "options": {"seq_len": 64, "max_bytes": 200_000, "eval_windows": 16}}
    data = {"model": m, "objective": {"name": "causal_lm"}, "data": text}
    return load_config(data, [f"train.batch_size={batch}", "train.precision=auto"])


def policy(asked: str, config, recorded=None) -> P.Precision:
    """What a run of ``config`` asking for ``asked`` trains at, measured as a run measures it."""
    return P.policy(asked, "cpu", config, E.step_speedup, recorded)


def shared(configs) -> P.Precision | None:
    return P.shared("cpu", configs, E.step_speedup)


def test_auto_is_fp32_without_bf16_instructions_and_measures_nothing(monkeypatch, tmp_path):
    cpu(monkeypatch, tmp_path, bf16=False)
    assert policy("auto", shaped(256)) == P.Precision("fp32", NO_BF16, P.DECIDED)


def test_auto_is_bf16_where_a_step_runs_enough_faster_measured_once_per_step(monkeypatch, tmp_path):
    measured = cpu(monkeypatch, tmp_path, bf16=True, ratio=1.9)
    chosen = policy("auto", shaped(256))
    reason = (
        "auto: a training step runs 1.90x as fast in bf16 (causal_lm on stdlib_bytes, decoder 2L width 256, 8 x 64 "
        "tokens)"
    )
    assert chosen == P.Precision("bf16", reason, P.DECIDED)
    assert policy("auto", shaped(256)) == chosen and policy("auto", shaped(64)).value == "bf16"
    assert measured == [256, 64]  # the second ask at 256 is the cache's
    policy("auto", shaped(256, batch=16))
    policy("auto", shaped(256, dropout=0.1))
    policy("auto", shaped(256, layers=3))
    assert measured == [256, 64, 256, 256, 256]  # another micro-batch, dropout or depth is another step
    policy("auto", shaped(256, scheme="deepnorm"))
    policy("auto", shaped(256, scheme="admin", admin_omega="profile"))
    policy("auto", load_config(shaped(256).model_dump(), ["train.seed=3", "train.lr=0.1", "train.steps=7"]))
    policy("auto", load_config(shaped(256, batch=16).model_dump(), ["train.accumulate=2", "train.compile=model"]))
    assert len(measured) == 5  # a residual scheme or its options, seed, budget, accumulation to the same micro-batch
    # or compile not
    assert (tmp_path / "cache" / P.CACHE_FILE).is_file()


@pytest.mark.parametrize("ratio,said", [(0.6, "0.60x"), (1.04, "1.04x"), (1.0497, "1.050x")])
def test_auto_is_fp32_where_bf16_does_not_pay_for_the_step(monkeypatch, tmp_path, ratio, said):
    """Under the 1.05x that pays, however close: a ratio that two decimals would round onto it gets three."""
    cpu(monkeypatch, tmp_path, bf16=True, ratio=ratio)
    chosen = policy("auto", shaped(128))
    assert (chosen.value, chosen.reason) == (
        "fp32",
        f"auto: a training step runs {said} as fast in bf16 (causal_lm on stdlib_bytes, decoder 2L width 128, "
        "8 x 64 tokens), under the 1.05x that pays (avx512_bf16)",
    )
    cpu(monkeypatch, tmp_path / "at", bf16=True, ratio=P.MIN_STEP_SPEEDUP)
    assert policy("auto", shaped(128)).value == "bf16"  # at the cut: bf16


def test_a_step_that_cannot_be_timed_trains_at_fp32_saying_why_and_is_timed_again_next_time(monkeypatch, tmp_path):
    cpu(monkeypatch, tmp_path, bf16=True)
    calls = []

    def fails(config):
        calls.append(config.model.width)
        raise OSError("[Errno 28] No space left on device")

    monkeypatch.setattr(E, "step_speedup", fails)
    assert policy("auto", shaped(64)) == P.Precision(
        "fp32",
        "auto: timing a step of causal_lm on stdlib_bytes, decoder 2L width 64, 8 x 64 tokens failed ([Errno 28] No "
        "space left on device)",
        P.DECIDED,
    )
    policy("auto", shaped(64))
    assert calls == [64, 64]  # a failure is not cached
    untrained = load_config(shaped(64).model_dump(), ["train.steps=0", "train.untrained=true"])
    assert policy("auto", untrained) == P.Precision("fp32", "auto: an untrained run takes no step to time", P.DECIDED)
    assert calls == [64, 64]


def test_a_ratio_measured_on_a_busy_machine_says_so_and_is_measured_again_once_it_is_quieter(monkeypatch, tmp_path):
    measured = cpu(monkeypatch, tmp_path, bf16=True, ratio=lambda width: 0.8 if not measured[1:] else 1.5)
    monkeypatch.setattr(P, "load_per_cpu", lambda: 1.5)
    busy = policy("auto", shaped(64))
    assert busy.value == "fp32" and busy.reason.startswith(
        "auto: a training step runs 0.80x as fast in bf16 (causal_lm on stdlib_bytes, decoder 2L width 64, 8 x 64 "
        "tokens; measured at a load of 1.50 per CPU, measured again when the machine is quieter)"
    )
    assert policy("auto", shaped(64)) == busy and measured == [64]  # still busy: the cached ratio
    monkeypatch.setattr(P, "load_per_cpu", lambda: 0.2)
    assert policy("auto", shaped(64)).reason == (
        "auto: a training step runs 1.50x as fast in bf16 (causal_lm on stdlib_bytes, decoder 2L width 64, 8 x 64 "
        "tokens)"
    )
    assert policy("auto", shaped(64)).value == "bf16" and measured == [64, 64]


def test_the_probe_times_as_many_rounds_in_either_order():
    """At least eight rounds and an even number: a slow step's few rounds do not favour the one called first."""
    order: list[str] = []
    P.ratio_in_turns(lambda: order.append("a"), lambda: order.append("b"), seconds=0.0)
    rounds = [order[i : i + 2] for i in range(2, len(order), 2)]  # after the warm-up's pair
    assert len(rounds) >= 8 and len(rounds) % 2 == 0
    assert rounds.count(["a", "b"]) == rounds.count(["b", "a"])


def test_a_given_precision_is_never_overridden(monkeypatch, tmp_path):
    cpu(monkeypatch, tmp_path, bf16=True, ratio=3.0)
    recorded = P.Precision("bf16", "auto: a training step runs 3.00x as fast in bf16", P.DECIDED)
    assert policy("fp32", shaped(32), recorded) == P.Precision("fp32", "train.precision", P.GIVEN)
    assert policy("bf16", shaped(32)) == P.Precision("bf16", "train.precision", P.GIVEN)


def test_runs_compared_with_one_another_share_one_precision(monkeypatch, tmp_path):
    """A study's or a search's runs: bf16 only where it pays for every step among them, else fp32 naming the step
    that does not pay; the residual scheme is no part of a step; runs given a precision take no part."""
    measured = cpu(monkeypatch, tmp_path, bf16=True, ratio=lambda width: {32: 2.0, 64: 1.04, 128: 1.6}[width])
    wide_and_narrow = shared([shaped(32), shaped(64), shaped(32, scheme="deepnorm"), shaped(128)])
    assert measured == [32, 64]  # the first step that does not pay decides: the ones after it are not measured
    assert wide_and_narrow == P.Precision(
        "fp32",
        "auto: a training step runs 1.04x as fast in bf16 (causal_lm on stdlib_bytes, decoder 2L width 64, 8 x 64 "
        "tokens), under the 1.05x that pays (avx512_bf16); one precision for the 3 steps compared",
        P.DECIDED,
    )
    both = shared([shaped(32), shaped(128)])
    assert both.value == "bf16" and both.reason.endswith(
        "; one precision for the 2 steps compared: bf16 pays for every one"
    )
    assert shared([shaped(64, scheme="post_ln"), shaped(64, scheme="deepnorm")]) == policy(
        "auto", shaped(64)
    )  # one step: its own decision
    given = load_config(shaped(32).model_dump(), ["train.precision=fp32"])
    assert shared([given]) is None
    # handed over: auto decides it in this process and in the runs it starts; given precisions stand
    assert P.SHARED_ENV not in os.environ
    with P.sharing(wide_and_narrow):
        assert policy("auto", shaped(32)) == wide_and_narrow
        assert os.environ[P.SHARED_ENV] == f"fp32\t{wide_and_narrow.reason}"
        assert policy("bf16", shaped(32)).value == "bf16"
    assert P.SHARED_ENV not in os.environ and policy("auto", shaped(32)).value == "bf16"


def test_a_study_resumed_goes_on_at_the_precision_its_runs_began_with(monkeypatch, tmp_path):
    """Its runs recorded one precision: that one, whatever this machine would decide now; recorded mixed: decided
    anew (the report's precision line shows the mix); untrained baselines take no part."""
    from kilolayer.train.run import shared_precision

    cpu(monkeypatch, tmp_path, bf16=True, ratio=2.0)
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for run in runs:
        run.mkdir()
    configs = [shaped(32), shaped(64)]
    assert shared_precision(configs, runs).value == "bf16"  # nothing recorded: decided here
    rundir.write_status(runs[0], "completed", 4, "step budget", precision="fp32", precision_reason=NO_BF16)
    assert shared_precision(configs, runs) == P.Precision("fp32", "auto, as the runs compared began: fp32", P.DECIDED)
    rundir.write_status(runs[1], "interrupted", 2, "signal", precision="bf16", precision_reason="auto")
    assert shared_precision(configs, runs).value == "bf16"  # mixed: decided here
    untrained = load_config(shaped(32).model_dump(), ["train.steps=0", "train.untrained=true"])
    assert shared_precision([untrained]) is None


def test_a_handed_precision_this_machine_cannot_use_or_cannot_read_is_passed_over(monkeypatch, tmp_path, capsys):
    cpu(monkeypatch, tmp_path, bf16=False)
    monkeypatch.setenv(P.SHARED_ENV, "bf16\tauto: decided on another machine")
    assert policy("auto", shaped(32)) == P.Precision("fp32", NO_BF16, P.DECIDED)  # no bf16 here
    monkeypatch.setenv(P.SHARED_ENV, "fp32\tauto: decided on another machine")
    assert policy("auto", shaped(32)).reason == "auto: decided on another machine"
    monkeypatch.setenv(P.SHARED_ENV, "BF16")
    assert policy("auto", shaped(32)) == P.Precision("fp32", NO_BF16, P.DECIDED)
    policy("auto", shaped(32))
    assert capsys.readouterr().err == (
        f"kilolayer: {P.SHARED_ENV}='BF16': expected fp32 or bf16, a tab and the reason; passed over\n"
    )  # said once


@pytest.mark.integration
def test_a_study_of_a_wide_and_a_narrow_model_trains_both_at_one_precision(monkeypatch, tmp_path, forked_points):
    """The narrow model does not pay for bf16, so neither trains in it: each run records the study's decision."""
    from test_study import BASE

    from kilolayer.study.runner import run_study
    from kilolayer.study.spec import load_spec

    cpu(monkeypatch, tmp_path, bf16=True, ratio=lambda width: {32: 2.0, 16: 1.02}[width])
    base = {**BASE, "train": {**BASE["train"], "precision": "auto", "diagnostics_every": 0}}
    grid = {"model.width,model.ffn": [[32, 64], [16, 32]]}
    spec = {"name": "two", "description": "two widths", "groups": [{"name": "g", "base": base, "grid": grid}]}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    results = run_study(load_spec(tmp_path / "spec.yaml"), tmp_path / "study", log=lambda *_: None)
    assert [r.status for r in results] == ["completed", "completed"]
    recorded = {(r.precision, r.precision_reason) for r in results}
    assert recorded == {("fp32", shared([r.config for r in results]).reason)}
    assert "width 16" in next(iter(recorded))[1] and P.SHARED_ENV not in os.environ
    # the report's command names the study's decision, and run by hand it continues the run as it is
    from kilolayer.cli import main

    command = shlex.split(results[0].command)
    assert command[-2:] == ["--set", "train.precision=fp32"]
    before = (results[0].point.run_dir(tmp_path / "study") / "metrics.jsonl").read_text()
    assert main(command[1:]) == 0
    assert (results[0].point.run_dir(tmp_path / "study") / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_the_step_ratio_is_a_positive_number_and_leaves_the_random_streams_alone(arch):
    import random

    import numpy as np

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    config = shaped(32)
    if arch == "encoder_decoder":
        config = load_config(
            {
                "model": {"arch": arch, "layers": 1, "decoder_layers": 1, "width": 32, "heads": 2, "ffn": 64},
                "objective": {"name": "seq2seq"},
                "data": {"name": "synthetic", "task": "reverse"},
            },
            ["train.precision=auto"],
        )
    probe = P.StepShape.of(config)
    ratio = E.step_speedup(probe.config, seconds=0.02)
    assert 0 < ratio < float("inf")
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1])
    assert torch.equal(after[0], before[0]) and after[1] == before[1] and (after[2] == before[2]).all()


@pytest.mark.bf16_as_is
def test_this_cpus_probe_names_what_it_found():
    has, what = P.cpu_bf16()
    assert isinstance(has, bool) and what
    if not has:  # e.g. "avx2": torch's vector capability in lower case
        assert what == torch.backends.cpu.get_cpu_capability().lower()


def test_a_precision_other_than_fp32_bf16_or_auto_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(tiny_lm(precision="fp16"))
    assert str(err.value) == "train.precision='fp16': input should be 'fp32', 'bf16' or 'auto'"


# ---------------------------------------------------------------- a run


def lm(steps: int, **train) -> dict:
    return tiny_lm(steps=steps, batch_size=4, checkpoint_every=3, log_every=1, peak_flops=1e11, **train)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in rundir.read_metrics(run) if r.get("split") == "train"]


def test_an_auto_run_records_its_precision_says_it_first_and_a_resume_keeps_it_bit_exact(monkeypatch, tmp_path, capsys):
    cpu(monkeypatch, tmp_path, bf16=True, ratio=2.0)
    whole, legs = tmp_path / "whole", tmp_path / "legs"
    train(lm(6, precision="auto"), whole)
    assert capsys.readouterr().err.splitlines()[:2] == [
        "kilolayer: timing training steps of causal_lm on stdlib_bytes, decoder 2L width 32, 4 x 32 tokens in bf16 "
        "against fp32, once on this machine (train.precision: auto)",
        "kilolayer: precision bf16 (auto: a training step runs 2.00x as fast in bf16 (causal_lm on stdlib_bytes, "
        "decoder 2L width 32, 4 x 32 tokens))",
    ]
    st = rundir.read_status(whole)
    assert (st["precision"], st["precision_reason"]) == (
        "bf16",
        "auto: a training step runs 2.00x as fast in bf16 (causal_lm on stdlib_bytes, decoder 2L width 32, 4 x 32 "
        "tokens)",
    )

    train(lm(3, precision="auto"), legs, quiet=True)
    rundir.write_status(legs, "failed", 3, "killed")  # a status that lost the fields: the checkpoint still says
    cpu(monkeypatch, tmp_path / "now", bf16=False)  # the probe would now decide fp32
    capsys.readouterr()
    train(None, legs, resume=True, sets=["train.steps=6"])
    assert capsys.readouterr().err.splitlines()[0] == (
        "kilolayer: precision bf16 (as recorded in its checkpoint; the run's own, reused on resume)"
    )
    assert rundir.read_status(legs)["precision"] == "bf16"
    assert losses(legs) == losses(whole)  # bf16 steps all the way: bit for bit

    # a fresh auto run on the CPU as it is now trains in fp32, and its losses are not the bf16 run's
    fresh = tmp_path / "fresh"
    train(lm(6, precision="auto"), fresh, quiet=True)
    assert rundir.read_status(fresh)["precision_reason"] == NO_BF16
    assert losses(fresh) != losses(whole)


def test_a_resume_given_fp32_trains_fp32_and_a_run_from_before_auto_keeps_its_configs(monkeypatch, tmp_path):
    cpu(monkeypatch, tmp_path, bf16=True, ratio=2.0)
    run = tmp_path / "run"
    train(lm(3, precision="auto"), run, quiet=True)
    train(None, run, resume=True, quiet=True, sets=["train.steps=4", "train.precision=fp32"])
    assert (rundir.read_status(run)["precision"], rundir.read_status(run)["precision_reason"]) == (
        "fp32",
        "train.precision",
    )
    old = tmp_path / "old"  # trained at fp32 before runs recorded a precision: its config.yaml names it
    train(lm(3), old, quiet=True)
    rundir.write_status(old, "interrupted", 3, "stopped")
    for ckpt in (old / "checkpoints").iterdir():
        shutil.rmtree(ckpt)
    assert recorded_precision(old) == P.Precision("fp32", "as recorded in its config.yaml", P.RECORDED)


# ---------------------------------------------------------------- studies, search, report, doctor


def test_the_builtin_studies_ask_for_auto_and_a_study_trained_at_fp32_keeps_its_points(monkeypatch, tmp_path):
    from kilolayer.study.builtin import BUILTIN
    from kilolayer.study.runner import changed_config
    from kilolayer.study.spec import expand, load_spec

    for name in BUILTIN:
        points, forced = expand(load_spec(name)), expand(load_spec(name, ["train.precision=fp32"]))
        assert {p.config.train.precision for p in points} == {"auto"}, name
        assert {p.config.train.precision for p in forced} == {"fp32"}, name  # one flag gives fp32
        assert [p.key for p in points] == [p.key for p in forced], name  # run directories keep their names

    # a point of `quick` trained at fp32 (launch config and run both fp32), re-run with the study's auto
    point = expand(load_spec("quick"))[0]
    out = tmp_path / "study"
    launched = load_config(point.config.model_dump(), ["train.precision=fp32"])
    (out / "configs" / point.group).mkdir(parents=True)
    (out / "configs" / point.group / f"{point.name}.yaml").write_text(dump_yaml(launched))
    point.run_dir(out).mkdir(parents=True)
    (point.run_dir(out) / rundir.CONFIG).write_text(dump_yaml(launched))
    rundir.write_status(point.run_dir(out), "completed", point.config.train.steps, "step budget")
    cpu(monkeypatch, tmp_path, bf16=False)
    assert changed_config(point, out) is None  # auto decides fp32 here: the same run, reused
    cpu(monkeypatch, tmp_path / "bf16", bf16=True, ratio=1.5)
    assert changed_config(point, out) == "its config changed since it ran (train.precision: 'fp32' -> 'auto')"


def test_a_changed_cpu_attention_is_a_speed_option_a_run_keeps(tmp_path):
    """A finished point launched with another model.cpu_attention is the point's result still, at either
    precision; a run resumed with a config that names another keeps its own (configs written with the boolean
    attention_fp32_cpu resume under the default)."""
    from kilolayer.study.runner import changed_config
    from kilolayer.study.spec import expand, load_spec
    from kilolayer.train.run import resolve_config

    point = expand(load_spec("quick", ["train.precision=bf16"]))[0]
    for trained in ("fp32", "bf16"):
        out = tmp_path / trained
        launched = load_config(point.config.model_dump(), [f"train.precision={trained}"])
        old_style = launched.model_dump()
        old_style["model"].pop("cpu_attention")
        old_style["model"]["attention_fp32_cpu"] = True
        (out / "configs" / point.group).mkdir(parents=True)
        (out / "configs" / point.group / f"{point.name}.yaml").write_text(yaml.safe_dump(old_style))
        point.run_dir(out).mkdir(parents=True)
        (point.run_dir(out) / rundir.CONFIG).write_text(yaml.safe_dump(old_style))
        rundir.write_status(point.run_dir(out), "completed", point.config.train.steps, "step budget")
        expected = None if trained == "bf16" else "its config changed since it ran (train.precision: 'fp32' -> 'bf16')"
        assert changed_config(point, out) == expected, trained
        resumed = resolve_config(point.config.model_dump(), point.run_dir(out), resume=True)
        assert resumed.model.cpu_attention == "fp32"  # the run's own


def test_the_search_trains_at_auto_unless_told_and_continues_a_search_trained_at_fp32(monkeypatch, tmp_path):
    from kilolayer.study import search as S

    settings = S.Settings(params=28_000, depths=(1, 3), tolerance=0.1)
    tiny = load_config("configs/digits_mae.yaml", ["train.steps=12"])
    assert S.check_settings(tiny, settings).train.precision == "auto"
    given = load_config("configs/digits_mae.yaml", ["train.steps=12", "train.precision=fp32"])
    assert S.check_settings(given, settings).train.precision == "fp32"

    out = tmp_path / "search"
    out.mkdir()
    S._check_same_search(out, S.check_settings(given, settings), settings)  # a search from before auto, at fp32
    cpu(monkeypatch, tmp_path, bf16=False)
    S._check_same_search(out, S.check_settings(tiny, settings), settings)  # auto decides fp32: continued
    cpu(monkeypatch, tmp_path / "bf16", bf16=True, ratio=1.5)
    with pytest.raises(ConfigError, match=r"config\.train\.precision differ"):
        S._check_same_search(out, S.check_settings(tiny, settings), settings)


def test_a_search_resumed_goes_on_at_the_precision_its_trials_began_with_and_a_bad_out_is_refused_first(
    monkeypatch, tmp_path
):
    from kilolayer.study import search as S

    settings = S.Settings(params=28_000, depths=(1, 3), tolerance=0.1)
    tiny = load_config("configs/digits_mae.yaml", ["train.steps=12"])
    cpu(monkeypatch, tmp_path, bf16=True)  # measuring a layer fails the test
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(ConfigError, match="a file, not a directory"):
        S.run_search(tiny, a_file, settings, log=lambda _: None)  # refused before any probe
    assert a_file.read_text() == "mine"

    handed = []
    monkeypatch.setattr(S, "_search", lambda *args: handed.append(args[-1]))
    cpu(monkeypatch, tmp_path, bf16=True, ratio=2.0)
    out = tmp_path / "search"
    S.run_search(tiny, out, settings, log=lambda _: None)  # a new search: decided here
    (out / S.TRIALS / "000-x").mkdir(parents=True)
    S._check_same_search(out, S.check_settings(tiny, settings), settings)
    rundir.write_status(out / S.TRIALS / "000-x", "interrupted", 4, "signal", precision="fp32", precision_reason="x")
    S.run_search(tiny, out, settings, log=lambda _: None)  # bf16 would pay 2.0x: the trial's fp32 stands
    assert [p.value for p in handed] == ["bf16", "fp32"]
    assert handed[1] == P.Precision("fp32", "auto, as the runs compared began: fp32", P.DECIDED)


def test_the_report_and_the_doctor_say_the_precision(monkeypatch, tmp_path):
    from kilolayer.doctor.diagnose import diagnose
    from kilolayer.record import RunRecord
    from kilolayer.study.report import precision_line

    cpu(monkeypatch, tmp_path, bf16=False)
    run = tmp_path / "run"
    train(lm(3, precision="auto"), run, quiet=True)
    record = RunRecord.read(run)
    assert (record.precision, record.precision_reason) == ("fp32", NO_BF16)
    made_up = [
        SimpleNamespace(precision="fp32", precision_reason=NO_BF16),
        SimpleNamespace(precision="fp32", precision_reason=NO_BF16),
        SimpleNamespace(precision="bf16", precision_reason="train.precision"),
        SimpleNamespace(precision="", precision_reason=""),  # not started: left out
    ]
    assert precision_line(made_up) == f"fp32 for 2 runs ({NO_BF16}); bf16 for 1 run (train.precision)"

    d = diagnose(run, replay_steps=0, smoothness_samples=0)
    assert d.summary.endswith(", fp32)")
    assert d.status["precision"] == "fp32" and d.status["precision_reason"] == NO_BF16
