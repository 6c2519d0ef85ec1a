"""`kilolayer doctor`: diagnosis lines on constructed run directories and on real small runs, the forecast,
DeepNet's update bound, and one-line errors."""

import json
import math
import re

import pytest
import torch

from kilolayer import rundir
from kilolayer.cli import main
from kilolayer.config import dump_yaml, load_config
from kilolayer.doctor import diagnose, forecast
from kilolayer.doctor.measure import deepnorm_first_update, replay
from kilolayer.doctor.theory import update_coefficient
from kilolayer.files import write_atomic

# a tiny encoder-decoder on the reverse task: replaying its first step takes well under a second
TINY = {
    "model": {
        "arch": "encoder_decoder",
        "scheme": "post_ln",
        "layers": 3,
        "decoder_layers": 3,
        "width": 16,
        "heads": 2,
        "ffn": 32,
        "vocab_size": 13,
        "max_len": 16,
    },
    "objective": {"name": "seq2seq", "options": {"decode_samples": 0}},
    "data": {
        "name": "synthetic",
        "task": "reverse",
        "options": {"vocab": 10, "min_len": 4, "max_len": 8, "eval_size": 32},
    },
    "train": {
        "steps": 20,
        "batch_size": 8,
        "lr": 1e-3,
        "warmup": 10,
        "eval_batches": 2,
        "eval_every": 10,
        "diagnostics_every": 5,
    },
}
ENC = [f"encoder.{i}" for i in range(3)]
DEC = [f"decoder.{i}" for i in range(3)]
LN = [
    f"{side}.layers.{i}.{sub}.post_norm"
    for side, subs in (("encoder", ("self_attn", "ffn")), ("decoder", ("self_attn", "cross_attn", "ffn")))
    for i in range(3)
    for sub in subs
]


def tiny(**changes) -> "Config":  # noqa: F821
    data = json.loads(json.dumps(TINY))
    for key, value in changes.items():
        section, name = key.split("__")
        if value is None:
            data[section].pop(name, None)
        else:
            data[section][name] = value
    return load_config(data)


def fake_run(
    path,
    config,
    *,
    grads=None,
    updates=(0.01, 0.02),
    ln=None,
    evals=(2.0, 1.5),
    status="completed",
    reason="",
    smoothness=None,
):
    """A run directory written through kilolayer.rundir, with hand-made diagnostics and losses."""
    path.mkdir(parents=True)
    write_atomic(path / rundir.CONFIG, dump_yaml(config))
    grads = grads or [1.0] * 6
    ln = ln or [1.0] * len(LN)
    lines = []
    for i, (step, update) in enumerate(zip((1, 5), updates)):
        lines.append({"step": step, "split": "train", "loss": 2.5 - 0.1 * i, "lr": 1e-4 * step})
        lines.append(
            {
                "step": step,
                "split": "diagnostics",
                "layers": ENC + DEC,
                "grad_norm": grads,
                "update": update,
                "ln_names": LN,
                "ln_input": ln,
            }
        )
    for i, loss in enumerate(evals):
        lines.append({"step": 10 * (i + 1), "split": "eval", "loss": loss})
    write_atomic(path / rundir.METRICS, "".join(rundir.metrics_line(r) for r in lines))
    rundir.write_status(path, status, 20 if status == "completed" else 7, reason)
    if smoothness is not None:
        (path / "analysis" / "smoothness").mkdir(parents=True)
        (path / "analysis" / "smoothness" / "smoothness.json").write_text(
            json.dumps({"layers": list(range(len(smoothness))), "cosine": smoothness})
        )
    return path


def codes(d):
    return [f.code for f in d.findings]


def finding(d, code):
    return next(f for f in d.findings if f.code == code)


# ---------------------------------------------------------------- DeepNet's bound


def test_deepnorm_constants_make_the_bound_one():
    """The bound as we read DeepNet's theorems: Figure 2(b)'s constants make every sum 1 at any depth."""
    for n in (1, 6, 100, 500):
        enc = load_config({"model": {"arch": "encoder", "layers": n, "scheme": "deepnorm"}}).model
        dec = load_config({"model": {"arch": "decoder", "layers": n, "scheme": "deepnorm"}}).model
        assert update_coefficient(enc) == pytest.approx(1.0)
        assert update_coefficient(dec) == pytest.approx(1.0)
        for m in (1, 6, 100):
            ed = load_config(
                {"model": {"arch": "encoder_decoder", "layers": n, "decoder_layers": m, "scheme": "deepnorm"}}
            ).model
            # decoder sum 1, plus the encoder's carried through cross-attention: (0.87/0.81)^2 * 4 / (12^.5 3^.25)
            assert update_coefficient(ed) == pytest.approx(1 + (0.87 / 0.81) ** 2 * 4 / (12**0.5 * 3**0.25))
    post = load_config({"model": {"arch": "encoder_decoder", "layers": 18, "decoder_layers": 18}}).model
    assert update_coefficient(post, "post_ln") == pytest.approx(6 * 18 + 4 * 18 * 18)  # 6M + 4NM
    enc = load_config({"model": {"arch": "encoder", "layers": 12}}).model
    assert update_coefficient(enc, "post_ln") == pytest.approx(4 * 12)  # 4N
    assert update_coefficient(enc, "pre_ln") is None  # not of the theorem's form


def test_post_ln_init_bound_stays_below_a_constant():
    """Post-LN-init's gains 1/k_l on V, O, W1, W2 (k_l = N - l + 1) make each sublayer count (2 / k_l^2), so
    one stack sums to 4 S_N and an encoder-decoder to 6 S_M + S_M 4 S_N, S_n = sum_{k<=n} 1/k^2 < pi^2/6:
    bounded at any depth (below 2 pi^2 / 3 and pi^2 + pi^4 / 9), where Post-LN's grows as 4N and 6M + 4NM."""

    def s(n):
        return sum(1 / k**2 for k in range(1, n + 1))

    for n in (1, 6, 18, 500):
        enc = load_config({"model": {"arch": "encoder", "layers": n, "scheme": "post_ln_init"}}).model
        assert update_coefficient(enc) == pytest.approx(4 * s(n)) and update_coefficient(enc) < 2 * math.pi**2 / 3
        ed = load_config(
            {"model": {"arch": "encoder_decoder", "layers": n, "decoder_layers": 7, "scheme": "post_ln_init"}}
        ).model
        assert update_coefficient(ed) == pytest.approx(6 * s(7) + s(7) * 4 * s(n))
        assert update_coefficient(ed) < math.pi**2 + math.pi**4 / 9
    for scheme in ("r_fixup", "dlcl", "branchnorm"):  # not of the theorem's form: no bound known here
        assert update_coefficient(enc, scheme) is None


# ---------------------------------------------------------------- constructed runs


def test_vanishing_bottom_gradients(tmp_path):
    grads = [1.0, 1.0, 1.0, 1e-4, 1e-2, 1.0]  # decoder: bottom 1e-4 of the top
    d = diagnose(fake_run(tmp_path / "run", tiny(), grads=grads), smoothness_samples=0)
    assert "vanishing_gradients" in codes(d)
    f = finding(d, "vanishing_gradients")
    assert f.evidence["side"] == "decoder"
    assert "gradients at the bottom of the decoder are 1.0e-04 of the top's at step 1 (Post-LN's vanishing" in f.text
    assert "model.scheme=deepnorm" in f.suggestion and "1.0e-04" in f.suggestion
    assert not any("bottom of the encoder" in x.text for x in d.findings)
    assert any(line.startswith("fine: encoder bottom/top gradient 1 at step 1") for line in d.lines)


def test_exploding_first_update_of_a_deep_model(tmp_path):
    config = tiny(model__layers=18, model__decoder_layers=18)
    d = diagnose(fake_run(tmp_path / "run", config, updates=(50.0, 60.0)), smoothness_samples=0)
    f = finding(d, "large_update")
    reference = deepnorm_first_update(config)
    assert f.evidence["deepnorm"] == pytest.approx(reference)
    assert f.evidence["ratio"] == pytest.approx(50.0 / reference)
    assert f"{50.0 / reference:.3g}x that of a DeepNorm model of this shape" in f.text
    # DeepNet's bound at 18L-18L: Post-LN 6M + 4NM = 1404 vs DeepNorm's 2.01
    bound = update_coefficient(config.model, "deepnorm")
    assert f"{1404 / bound:.0f}x DeepNorm's (1404 vs 2.01 x lr: a bound, not a prediction)" in f.text
    assert "train.lr" in f.suggestion and "model.scheme=deepnorm" in f.suggestion


def test_a_shallow_models_large_first_update_is_not_flagged(tmp_path):
    """Below 18 layers per side (the depth of DeepNet's analysis) a first update 10x DeepNorm's is stated, not
    blamed on depth: no finding, no DeepNorm advice, the ratio on the fine line."""
    config = tiny()  # 3L-3L
    d = diagnose(fake_run(tmp_path / "run", config, updates=(1.0, 1.2)), smoothness_samples=0)
    ratio = 1.0 / deepnorm_first_update(config)
    assert ratio >= 10 and codes(d) == []
    assert (
        f"first update 1 = {ratio:.3g}x DeepNorm's at this shape and lr (not flagged at 3L-3L, below the 18 "
        "layers per side where DeepNet shows depth's trouble)"
    ) in fine_line(d)
    assert not any("deepnorm" in line for line in d.lines)


def fine_line(d) -> str:
    return next(line for line in d.lines if line.startswith("fine: "))


def pre_ln_run(path, layers: int, growth: float = 2.0):
    """A Pre-LN encoder-decoder of ``layers`` per side whose LayerNorm inputs grow by ``growth`` each layer."""
    config = tiny(model__scheme="pre_ln", model__layers=layers, model__decoder_layers=layers)
    names = [n.replace("post_norm", "pre_norm") for n in LN]
    ln = [growth ** int(n.split(".")[2]) for n in names]  # 1, 2, 4 by logged layer on both sides
    run = fake_run(path, config, ln=ln)
    records = rundir.read_metrics(run)
    for r in records:
        if r["split"] == "diagnostics":
            r["ln_names"] = names
    write_atomic(run / rundir.METRICS, "".join(rundir.metrics_line(r) for r in records))
    return run


def test_growing_layernorm_inputs_of_a_deep_pre_ln_model(tmp_path):
    d = diagnose(pre_ln_run(tmp_path / "run", 18), smoothness_samples=0)
    growth = [f for f in d.findings if f.code == "ln_growth"]
    assert {f.evidence["side"] for f in growth} == {"encoder", "decoder"}
    assert all(f.evidence["growth"] == pytest.approx(4.0) for f in growth)
    assert "LayerNorm inputs grow layer by layer in the encoder: 4x from the first layer to the last" in growth[0].text
    assert "(Pre-LN's weakness at depth)" in growth[0].text and "model.scheme=deepnorm" in growth[0].suggestion


def test_a_shallow_pre_ln_model_gets_no_depth_advice(tmp_path):
    """A 3-layer Pre-LN model whose LayerNorm inputs grow 4x: the residual stream adding up, stated on the fine
    line; neither Pre-LN's weakness at depth nor DeepNorm is named."""
    d = diagnose(pre_ln_run(tmp_path / "run", 3), smoothness_samples=0)
    assert codes(d) == []
    fine = fine_line(d)
    for side in ("encoder", "decoder"):
        assert (
            f"{side} LayerNorm inputs 4x first to last layer (Pre-LN's residual stream adds up each layer's output; "
            "not flagged at 3L-3L, below the 18 layers per side where DeepNet shows depth's trouble)"
        ) in fine
    assert not any("deepnorm" in line or "weakness at depth" in line for line in d.lines)


def test_over_smoothed_tokens(tmp_path):
    config = tiny(
        model__arch="encoder",
        model__decoder_layers=0,
        objective__name="classification",
        objective__options={"pool": "cls"},
        data__name="digits",
        data__task=None,
        data__options={},
        model__input="patches",
        model__image_size=8,
        model__patch_size=2,
        model__channels=1,
    )
    deep = config.model_copy(update={"model": config.model.model_copy(update={"layers": 18})})
    cosines = [0.1, 0.5, 0.8, 0.96]
    run = fake_run(tmp_path / "run", deep, smoothness=cosines)
    d = diagnose(run, replay_steps=0)
    f = finding(d, "oversmoothing")
    assert f.evidence["last"] == pytest.approx(0.96)
    assert "last-layer tokens are 0.960 similar" in f.text and "sequence-level objective" in f.text
    assert "token-level objective" in f.suggestion
    # a 3-layer model: the cosine on the fine line, no depth advice
    d = diagnose(fake_run(tmp_path / "shallow", config, smoothness=cosines), replay_steps=0)
    assert "oversmoothing" not in codes(d) and not any("fewer" in line for line in d.lines)
    assert "last-layer token cosine 0.960 (embedding 0.10; not flagged at 3L, below the 18 layers" in fine_line(d)
    # a deep model that learned nothing (0.93 x chance): alike tokens for want of learning, not over-smoothing
    from kilolayer.analysis.chance import chance_level

    level = chance_level(deep)["loss"]
    d = diagnose(fake_run(tmp_path / "idle", deep, evals=(level, 0.93 * level), smoothness=cosines), replay_steps=0)
    assert "oversmoothing" not in codes(d) and "learned_nothing" in codes(d)
    assert "not flagged: the run learned almost nothing" in fine_line(d)


def test_never_below_chance(tmp_path):
    from kilolayer.analysis.chance import chance_level

    config = tiny()
    level = chance_level(config)["loss"]
    d = diagnose(fake_run(tmp_path / "run", config, evals=(level + 0.3, level + 0.01)), smoothness_samples=0)
    f = finding(d, "never_below_chance")
    assert f.evidence["chance"] == pytest.approx(level) and f.evidence["best_eval"] == pytest.approx(level + 0.01)
    assert f"best eval loss {level + 0.01:.4g} >= chance {level:.4g}" in f.text
    assert d.outcome["label"] == "stalls"
    # just below chance but above 0.9 x chance: learned nothing, by the study report's rule
    d = diagnose(fake_run(tmp_path / "run2", config, evals=(level, 0.95 * level)), smoothness_samples=0)
    assert "learned_nothing" in codes(d) and "0.95 x the chance level" in finding(d, "learned_nothing").text


def test_healthy_run_has_no_findings(tmp_path):
    run = fake_run(tmp_path / "run", tiny(), evals=(1.0, 0.5))
    before = _snapshot(run)
    d = diagnose(run, smoothness_samples=0)
    assert _snapshot(run) == before  # nothing written into the run directory
    assert d.findings == [] and d.outcome["label"] == "trains"
    assert "- no problem found by the rules below" in d.lines
    data = d.to_dict()
    assert data["lines"] == d.lines and json.dumps(data)  # JSON-safe


def test_unreadable_status_and_no_losses(tmp_path):
    """A status.json that cannot be read is said so (not "no status.json"); a completed run that logged no
    loss has no outcome (it is not a stall)."""
    run = fake_run(tmp_path / "run", tiny())
    (run / "status.json").write_text("{cut")
    d = diagnose(run, replay_steps=0, smoothness_samples=0)
    assert "; status.json unreadable at step ?" in d.summary
    run = fake_run(tmp_path / "quiet", tiny())
    (run / "metrics.jsonl").unlink()
    d = diagnose(run, replay_steps=0, smoothness_samples=0)
    assert d.outcome["label"] is None and "holds no loss" in d.outcome["why"]


def test_diverged_status(tmp_path):
    run = fake_run(tmp_path / "run", tiny(), status="diverged", reason="non-finite loss (nan) at step 7")
    d = diagnose(run, smoothness_samples=0)
    assert d.findings[0].code == "diverged" and d.outcome["label"] == "diverges"
    assert "diverged at step 7" in d.findings[0].text and "non-finite loss" in d.findings[0].text
    assert "train.lr" in d.findings[0].suggestion


# ---------------------------------------------------------------- the replay and the forecast


def test_replay_matches_the_runs_logged_step(tmp_path):
    """Step 1 replayed in memory is step 1 of the real run: same gradients, update and LayerNorm inputs."""
    config = tiny(train__steps=5, train__diagnostics_every=1)
    from kilolayer.train.run import train

    train(config, tmp_path / "run", quiet=True)
    logged = [r for r in rundir.read_metrics(tmp_path / "run") if r["split"] == "diagnostics"]
    before = torch.get_rng_state()
    r = replay(config, 3)
    assert torch.get_rng_state().equal(before)  # the replay leaves the caller's random state alone
    for step, rec in zip(r.steps, logged[:3]):
        assert step.step == rec["step"]
        assert step.grad_norm == pytest.approx(rec["grad_norm"], rel=1e-6)
        assert step.update == pytest.approx(rec["update"], rel=1e-6)
        assert step.ln_input == pytest.approx(rec["ln_input"], rel=1e-6)


def _snapshot(*dirs):
    return {d: sorted(str(p.relative_to(d)) for p in d.rglob("*")) for d in dirs}


def test_forecast_leaves_no_files_behind(tmp_path, monkeypatch, capsys):
    import tempfile

    # torch's own: the first import of its compiler (any optimizer's constructor does it) makes an empty
    # $TMPDIR/torchinductor_<user>; `kilolayer train` does the same. Import it first, then check ours.
    import torch._dynamo  # noqa: F401

    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    cfg = cwd / "tiny.yaml"
    cfg.write_text(dump_yaml(tiny()))
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    before = _snapshot(cwd, tmp)
    assert main(["doctor", str(cfg), "--forecast", "--steps", "12", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] in ("trains", "stalls", "diverges") and data["measurements"]["steps_run"] == 12
    assert _snapshot(cwd, tmp) == before


def test_forecast_sees_a_learning_rate_that_diverges():
    # trained for real, this config diverges at step 3 (smoothed loss 350 > 10 x its minimum 3.1)
    f = forecast(tiny(train__lr=10.0, train__warmup=2, train__steps=40, train__clip=0.0), steps=30)
    assert f.verdict == "diverges"
    assert "the replay diverged: smoothed loss" in f.reason and f.measurements["steps_run"] == 3


def _error(args, capsys):
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kilolayer: error: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(dump_yaml(tiny()))
    assert "no such run directory" in _error(["doctor", str(tmp_path / "missing")], capsys)
    assert "not a kilolayer run directory" in _error(["doctor", str(tmp_path)], capsys)
    assert "add --forecast" in _error(["doctor", str(cfg)], capsys)
    assert "no such config file" in _error(["doctor", str(tmp_path / "missing.yaml"), "--forecast"], capsys)
    assert "model.width=7" in _error(["doctor", str(cfg), "--forecast", "--set", "model.width=7"], capsys)
    assert "--steps 0" in _error(["doctor", str(cfg), "--forecast", "--steps", "0"], capsys)
    assert "--set" in _error(["doctor", str(tmp_path), "--set", "train.lr=1"], capsys)
    assert "nothing to forecast" in _error(["doctor", str(cfg), "--forecast", "--set", "train.steps=0"], capsys)
    if not torch.cuda.is_available():
        assert "no CUDA device" in _error(["doctor", str(cfg), "--forecast", "--device", "cuda"], capsys)
    assert "train.lr" in _error(["doctor", str(cfg), "--forecast", "--set", "train.lr=-1"], capsys)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model: {width: [1, 2]}\n")
    assert "model.width" in _error(["doctor", str(tmp_path / "run")], capsys)
    # a damaged metrics.jsonl (a bad line before the last) names the file and line
    damaged = fake_run(tmp_path / "damaged", tiny())
    lines = (damaged / "metrics.jsonl").read_text().splitlines()
    (damaged / "metrics.jsonl").write_text("\n".join([lines[0], "{cut", *lines[2:]]) + "\n")
    assert "metrics.jsonl:2: not a JSON object" in _error(["doctor", str(damaged)], capsys)
    with pytest.raises(SystemExit) as exit_:
        main(["doctor", str(cfg), "--forecast", "--bogus"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in err and "\n" not in err


# ---------------------------------------------------------------- real small runs


def small(scheme, lr, layers=12, steps=40, warmup=30):
    """Reverse-digits encoder-decoders, width 32, 40 steps: the forecast's default replay is the whole run.
    Trained here: Post-LN 12L-12L at lr 1e-2 stalls (standing eval loss 0.96 x chance), DeepNorm trains (0.73 x
    chance); Post-LN 2L-2L at lr 10 diverges at step 11."""
    return load_config(
        {
            "model": {
                "arch": "encoder_decoder",
                "scheme": scheme,
                "layers": layers,
                "decoder_layers": layers,
                "width": 32,
                "heads": 4,
                "ffn": 128,
                "vocab_size": 13,
                "max_len": 16,
            },
            "objective": {"name": "seq2seq", "options": {"decode_samples": 0}},
            "data": {
                "name": "synthetic",
                "task": "reverse",
                "options": {"vocab": 10, "min_len": 4, "max_len": 12, "eval_size": 128},
            },
            "train": {
                "steps": steps,
                "batch_size": 32,
                "lr": lr,
                "warmup": warmup,
                "schedule": "inverse_sqrt",
                "clip": 0.0,
                "eval_batches": 4,
                "diagnostics_every": 5,
                "diagnostics_until": 50,
            },
        }
    )


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    from kilolayer.errors import DivergedError
    from kilolayer.train.run import train

    root = tmp_path_factory.mktemp("real")
    runs = {
        "post_ln": small("post_ln", 1e-2),
        "deepnorm": small("deepnorm", 1e-2),
        "diverged": small("post_ln", 10.0, layers=2, steps=40, warmup=10),
    }
    torch.set_num_threads(1)
    for name, config in runs.items():
        try:
            train(config, root / name, quiet=True)
        except DivergedError:
            pass
    return {name: (root / name, config) for name, config in runs.items()}


@pytest.mark.slow
def test_diagnosis_of_real_runs(real_runs, capsys):
    run, _ = real_runs["post_ln"]
    before = _snapshot(run)
    d = diagnose(run)
    assert _snapshot(run) == before  # checkpoint, smoothness and chance measured without writing
    assert d.outcome["label"] == "stalls" and d.outcome["final_loss"] > 0.9 * d.outcome["chance"]
    vanishing = finding(d, "vanishing_gradients")
    assert vanishing.evidence["side"] == "decoder"
    assert min(p["ratio"] for p in vanishing.evidence["points"]) < 1e-3  # orders of magnitude, not a wobble
    assert "(Post-LN's vanishing pattern)" in vanishing.text and "model.scheme=deepnorm" in vanishing.suggestion
    # DeepNet: Post-LN's early update is large (measured 9.7x DeepNorm's here: said as a note below the 10x flag)
    flagged = [f.evidence["ratio"] for f in d.findings if f.code == "large_update"]
    noted = [float(m) for n in d.fine for m in re.findall(r"first update \S+ = ([0-9.]+)x DeepNorm's", n)]
    assert len(flagged + noted) == 1 and (flagged + noted)[0] > 5
    assert "the vanishing gradients above are the likely cause" in finding(d, "learned_nothing").suggestion

    run, _ = real_runs["deepnorm"]
    d = diagnose(run)
    assert d.outcome["label"] == "trains" and d.findings == []
    assert any("first update" in line and "its bound is 2.01 x lr at any depth" in line for line in d.lines)

    run, _ = real_runs["diverged"]
    assert main(["doctor", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["outcome"]["label"] == "diverges" and data["findings"][0]["code"] == "diverged"
    assert data["findings"][0]["text"].startswith("diverged at step ")
    assert "lower train.lr (peak 10)" in data["findings"][0]["suggestion"]


@pytest.mark.slow
def test_forecast_of_real_runs(real_runs, capsys):
    """Forecast from the configs alone, compared with what training them did."""
    from kilolayer.doctor import outcome

    verdicts = {}
    for name, (run, config) in real_runs.items():
        f = forecast(config)
        verdicts[name] = f.verdict
        assert f.verdict == outcome(run, config).label, (name, f.reason)
    assert verdicts == {"post_ln": "stalls", "deepnorm": "trains", "diverged": "diverges"}
    cfg = real_runs["post_ln"][0] / "config.yaml"
    assert main(["doctor", str(cfg), "--forecast", "--steps", "5"]) == 0  # the printout's form; 5 steps is quick
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("forecast: ") and "replayed 5 of 40 steps in memory" in "\n".join(out)
    assert any(line.startswith("evidence: first update") and "x a DeepNorm model's" in line for line in out)
    assert any(line.startswith("rule (first that holds): diverges:") for line in out)


def test_calibration_grids_are_valid_configs():
    """benchmarks/doctor_calibration.py: every point loads, names are unique, quick's match the study's."""
    from benchmarks.doctor_calibration import GRIDS
    from kilolayer.study.builtin import BUILTIN

    points = [p for grid in GRIDS.values() for p in grid()]
    assert len(points) == 18 + 45 + 18 and len({(p.grid, p.name) for p in points}) == len(points)
    for p in points:
        load_config(p.config)
    base = next(g for g in BUILTIN["quick"]()["groups"] if g["name"] == "deepnet")["base"]
    q = next(p for p in points if p.name == "scheme=post_ln_layers=18_decoder_layers=18_seed=1")
    assert q.config["train"] == {**base["train"], "seed": 1} and q.config["model"]["layers"] == 18


def test_too_slow_rule_on_a_constructed_replay():
    """The last lines of the forecast rule on constructed replays (chance 3.0, lr 1e-3 a step, 1,000 steps): a
    loss falling fast enough is forecast to train, with the share of the learning rate still to come after which
    a straight line at half its recent pace crosses 0.9 x chance; one falling too slowly stalls."""
    from kilolayer.doctor.forecast import decide

    def replay_of(losses):
        steps = list(range(1, len(losses) + 1))
        return {
            "chance": 3.0,
            "stopped": None,
            "ungated": None,
            "eval_loss0": 3.0,
            "per_step": {"step": steps, "eval_loss": losses, "lr": [1e-3] * len(steps), "grad_ratio": []},
            "schedule": {
                "steps": 1000,
                "lr": 1e-3,
                "lr_seen_max": 1e-3,
                "lr_sum_seen": 1e-3 * len(steps),
                "lr_sum_total": 1.0,
            },
        }

    # the second half (steps 20-40) falls 0.1: 0.1 / (20 x 1e-3) = 5 a unit of lr; 0.96 of lr still to come
    fast = [3.0 - 0.005 * max(0, s - 20) for s in range(1, 41)]
    verdict, reason, numbers = decide(replay_of(fast))
    assert verdict == "trains"
    assert numbers["rate"] == pytest.approx(5.0) and numbers["remaining_lr"] == pytest.approx(0.96)
    # 2.9 must fall to 2.7: 0.2 / (0.5 x 5 x 0.96) = 8.3% of what is to come
    assert numbers["crossing_share"] == pytest.approx(0.2 / (0.5 * 5 * 0.96))
    assert "crosses that line after 8% of the summed learning rate still to come" in reason
    steep = [3.0 - 0.0145 * max(0, s - 20) for s in range(1, 41)]  # 2.71 at step 40: 14.5 a unit of lr
    verdict, reason, numbers = decide(replay_of(steep))
    assert verdict == "trains" and "after <1% of the summed" in reason  # not "0%"
    slow = [3.0 - 0.0001 * max(0, s - 20) for s in range(1, 41)]  # half of 0.1 a unit of lr: 2.998 -> 2.95
    verdict, reason, numbers = decide(replay_of(slow))
    assert verdict == "stalls" and "would reach only 0.98 x chance by step 1000" in reason


def test_the_checkpoint_measured_gives_both_the_weights_and_the_step(tmp_path):
    """Under early stopping the run's standing checkpoint is its best, not its newest; the doctor measures the newest
    and must load that checkpoint's weights, not the best's under the newest's step."""
    from kilolayer.doctor.measure import at_checkpoint
    from kilolayer.train.run import train

    config = tiny(train__steps=4, train__checkpoint_every=2, train__diagnostics_every=1)
    run = tmp_path / "run"
    train(config, run, quiet=True)
    newest = rundir.latest_checkpoint(run)
    older = rundir.checkpoint_dir(run, 2)
    assert rundir.checkpoint_step(newest) == 4 and older.is_dir()
    # the newest checkpoint names step 2 as the run's best, as early stopping records it
    state = json.loads((newest / "state.json").read_text())
    state["trainer"]["best_step"] = 2
    (newest / "state.json").write_text(json.dumps(state))
    manifest = json.loads((newest / rundir.MANIFEST).read_text())
    manifest["files"].pop("state.json", None)
    (newest / rundir.MANIFEST).write_text(json.dumps(manifest))
    cfg = load_config(run / "config.yaml")
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"patience": 2})})
    write_atomic(run / "config.yaml", dump_yaml(cfg))
    assert rundir.chosen_checkpoint(run, 2) == older  # the run's standing checkpoint is the older one
    seen = {}
    import kilolayer.train.checkpoint as checkpoint

    real = checkpoint.load_run

    def spy(*a, **k):
        seen["ckpt"] = k.get("checkpoint")
        return real(*a, **k)

    checkpoint.load_run = spy
    try:
        m = at_checkpoint(run, cfg, replay(cfg, 1))
    finally:
        checkpoint.load_run = real
    assert m is not None and m.step == 4 and seen["ckpt"] == newest


def test_the_forecast_warns_of_a_large_first_update_only_in_a_deep_model():
    from kilolayer.doctor.forecast import warnings

    m = {"per_step": {"grad_ratio": [{"decoder": 0.5}]}, "update1": 2.0, "deepnorm_update1": 0.1}
    assert warnings({**m, "deep": False}) == []
    assert warnings({**m, "deep": True}) == [
        "the first update is 20x a DeepNorm model's of this shape (flagged at 10x): model.scheme=deepnorm, or a "
        "lower train.lr / longer train.warmup"
    ]
