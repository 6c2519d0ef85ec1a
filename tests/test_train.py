"""kilolayer train: outputs, resume bit for bit, crash safety, divergence, schedules, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import cli
from objective_helpers import tiny_lm

from kilolayer.cli import main
from kilolayer.config import load_config
from kilolayer.errors import ConfigError, InputError
from kilolayer.train.checkpoint import complete_checkpoints, load_run, read_weights
from kilolayer.train.optim import lr_factor, param_groups
from kilolayer.train.run import train

ROOT = Path(__file__).resolve().parents[1]

TINY_S2S = {
    "model": {
        "arch": "encoder_decoder",
        "scheme": "deepnorm",
        "layers": 2,
        "decoder_layers": 2,
        "width": 32,
        "heads": 2,
        "ffn": 64,
        "vocab_size": 16,
        "max_len": 16,
        "dropout": 0.1,
    },
    "objective": {"name": "seq2seq"},
    "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 8, "eval_size": 32}},
    "train": {
        "steps": 12,
        "batch_size": 8,
        "lr": 1e-3,
        "warmup": 4,
        "eval_every": 4,
        "checkpoint_every": 4,
        "log_every": 1,
        "keep_checkpoints": 10,
    },
}

TINY_LM = tiny_lm(steps=6, batch_size=4, lr=1e-3, log_every=1)


def losses(run: Path, split: str = "train") -> list[tuple[int, float]]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["split"] == split:
            out.append((r["step"], r["loss"]))
    return out


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kilolayer: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_run_directory_contract(tmp_path):
    out = tmp_path / "run"
    result = train(TINY_S2S, out, quiet=True)
    assert result == {"status": "completed", "step": 12}
    assert (out / "config.yaml").is_file() and (out / "tensorboard").is_dir()
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "completed" and status["step"] == 12
    # the resolved config reloads to the same config
    assert load_config(out / "config.yaml") == load_config(TINY_S2S)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all({"step", "split"} <= r.keys() for r in records)
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 13))
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12]
    scores = {f"{m}{end}" for m in ("exact_match", "bleu", "chrf") for end in ("", "_low", "_high")}
    assert all({"loss", "token_accuracy", *scores} == r.keys() - {"step", "split"} for r in evals)
    # the baselines of the same 32 pairs, once
    baselines = json.loads((out / "baselines.json").read_text())
    assert (baselines["data"], baselines["split"], baselines["pairs"]) == ("synthetic", "validation", 32)
    assert sorted(baselines["baselines"]) == ["copy", "shuffle"]
    assert all({*scores, "token_accuracy"} == b.keys() for b in baselines["baselines"].values())
    assert [p.name for p in complete_checkpoints(out)] == ["step_00000004", "step_00000008", "step_00000012"]
    config, task = load_run(out)
    assert config.model.layers == 2 and not task.training


@pytest.mark.parametrize("scheme", ["deepnorm", "post_ln_init", "r_fixup", "dlcl", "branchnorm"])
def test_resume_is_bit_identical(tmp_path, scheme):
    """For BranchNorm the schedule (8 steps here) ends after the resume, so the step it restarts from must be the
    one its checkpoint carries."""
    full, half = tmp_path / "full", tmp_path / "half"
    sets = [f"model.scheme={scheme}", "model.branchnorm_steps=8"]
    train(TINY_S2S, full, quiet=True, sets=sets)
    train(TINY_S2S, half, quiet=True, sets=[*sets, "train.steps=6"])  # checkpoints at 4 and 6
    weights = read_weights(complete_checkpoints(half)[-1] / "model.safetensors")
    steps = [int(v) for k, v in weights.items() if k.endswith("branch_scale.step")]
    assert steps == ([6] * (2 * 2 + 3 * 2) if scheme == "branchnorm" else [])
    train(None, half, resume=True, quiet=True, sets=["train.steps=12"])
    assert losses(full) == losses(half)
    # the first leg also evaluated at its last step (6); every other evaluation is the same
    assert losses(full, "eval") == [e for e in losses(half, "eval") if e[0] != 6]


@pytest.mark.integration
def test_corrupt_checkpoint_is_one_line(tmp_path):
    out = tmp_path / "run"
    train(TINY_LM, out, quiet=True, sets=["train.steps=2"])
    model_file = complete_checkpoints(out)[-1] / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])
    p = cli("train", "--resume", "--out", str(out), "--set", "train.steps=4")
    assert_one_line_error(p.returncode, p.stderr, "model.safetensors", "truncated")


@pytest.mark.filterwarnings("error")  # in-process: a warning a real run would print must fail the one-line check
def test_mismatched_checkpoint_is_one_line(tmp_path, capsys):
    """In-process (the corrupt checkpoint's test above crosses the process boundary)."""
    out = tmp_path / "run"
    train(TINY_LM, out, quiet=True, sets=["train.steps=2"])
    cfg = (out / "config.yaml").read_text().replace("width: 32", "width: 64")
    (out / "config.yaml").write_text(cfg)
    rc = main(["train", "--resume", "--out", str(out), "--set", "train.steps=4"])
    assert_one_line_error(rc, capsys.readouterr().err, "does not fit this model", "shape")


def test_resume_refuses_a_different_model(tmp_path):
    out = tmp_path / "run"
    train(TINY_LM, out, quiet=True, sets=["train.steps=2"])
    with pytest.raises(ConfigError, match="model.width=64: differs from the run being resumed"):
        train(TINY_LM, out, resume=True, quiet=True, sets=["model.width=64"])


def test_existing_run_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    train(TINY_LM, out, quiet=True, sets=["train.steps=2"])
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        train(TINY_LM, out, quiet=True)
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.filterwarnings("error")  # in-process: a warning a real run would print must fail the one-line check
def test_divergence_is_recorded_with_exit_code_3(tmp_path, monkeypatch, capsys):
    """In-process, from the repository root: the exit status main() hands to the interpreter, and its stderr."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            str(ROOT / "configs" / "stdlib_gpt.yaml"),
            "--out",
            str(out),
            "--quiet",
            "--set",
            "model.layers=2",
            "--set",
            "model.width=32",
            "--set",
            "model.heads=2",
            "--set",
            "model.ffn=64",
            "--set",
            "model.scheme=post_ln",
            "--set",
            "train.lr=1e4",
            "--set",
            "train.warmup=0",
            "--set",
            "train.clip=0",
            "--set",
            "train.steps=50",
            "--set",
            "train.checkpoint_every=1",
            "--set",
            "data.options.max_bytes=200000",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kilolayer: error: ") and "Traceback" not in err
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "diverged" and status["step"] >= 1 and status["reason"]
    # the last good checkpoint is kept, and is from before the divergence
    good = complete_checkpoints(out)
    assert good and int(good[-1].name.split("_")[1]) == status["last_checkpoint"] < status["step"]


def test_lr_schedules():
    tc = load_config({"train": {"steps": 100, "warmup": 10, "schedule": "inverse_sqrt", "lr": 1.0}}).train
    assert lr_factor(0, tc) == pytest.approx(0.1)
    assert lr_factor(9, tc) == pytest.approx(1.0)
    assert lr_factor(39, tc) == pytest.approx(math.sqrt(10 / 40))
    tc = load_config({"train": {"steps": 110, "warmup": 10, "schedule": "cosine", "min_lr_ratio": 0.1}}).train
    assert lr_factor(9, tc) == pytest.approx(1.0)
    assert lr_factor(59, tc) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(109, tc) == pytest.approx(0.1)


def test_no_weight_decay_on_norms_biases_and_gains():
    from kilolayer import build_model

    m = build_model({"scheme": "admin", "layers": 2, "width": 32, "heads": 2, "ffn": 64})
    decay, no_decay = param_groups(m, 0.1)
    ids = {id(p) for p in no_decay["params"]}
    for name, p in m.named_parameters():
        # learned position embeddings are exempt like CLS and mask tokens (timm's no_weight_decay)
        expect_no_decay = p.dim() < 2 or name.endswith("positions")
        assert (id(p) in ids) == expect_no_decay, name
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_accumulation_matches_full_batch(tmp_path):
    """Gradient accumulation over 2 micro-batches gives the same first-step loss and nearly the same run."""
    a = train(TINY_LM, tmp_path / "a", quiet=True, sets=["train.steps=3"])
    b = train(TINY_LM, tmp_path / "b", quiet=True, sets=["train.steps=3", "train.accumulate=2"])
    assert a == b
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    for (s1, x), (s2, y) in zip(la, lb):
        assert s1 == s2 and x == pytest.approx(y, rel=1e-4)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["train", "missing.yaml", "--out", "{tmp}/r"], ["missing.yaml"]),
        (
            ["train", "configs/stdlib_gpt.yaml", "--out", "{tmp}/r", "--set", "train.nonsense=1"],
            ["train.nonsense", "unknown key"],
        ),
        (
            ["train", "configs/stdlib_gpt.yaml", "--out", "{tmp}/r", "--set", "train.steps=many"],
            ["train.steps", "many"],
        ),
        (
            [
                "train",
                "configs/stdlib_gpt.yaml",
                "--out",
                "{tmp}/r",
                "--set",
                "data.name=text_bytes",
                "--set",
                "data.path={tmp}/nope.txt",
            ],
            ["nope.txt"],
        ),
        (
            [
                "train",
                "configs/stdlib_gpt.yaml",
                "--out",
                "{tmp}/r",
                "--set",
                "data.name=text_bytes",
                "--set",
                "data.path={tmp}/empty.txt",
            ],
            ["empty.txt", "empty"],
        ),
        (
            [
                "train",
                "configs/stdlib_gpt.yaml",
                "--out",
                "{tmp}/r",
                "--set",
                "data.name=text_bytes",
                "--set",
                "data.path={tmp}",
            ],
            ["cannot read"],
        ),
        (
            ["train", "configs/stdlib_gpt.yaml", "--out", "{tmp}/r", "--set", "objective.name=seq2seq"],
            ["model.arch", "seq2seq"],
        ),
        (["train", "--resume", "--out", "{tmp}/none"], ["nothing to resume"]),
    ],
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, args, needles):
    """In-process, from the repository root as ``cli()`` runs: the command's exit status and its whole stderr (the
    process boundary itself is the corrupt and mismatched checkpoints' tests above)."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "empty.txt").write_text("")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    rc = main(args)
    assert_one_line_error(rc, capsys.readouterr().err, *needles)


def test_parallel_text_files(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))  # the nearest-neighbour baseline's
    src = tmp_path / "src.txt"
    tgt = tmp_path / "tgt.txt"
    words = ["ein haus", "der hund", "die katze", "ein baum", "das boot", "der tisch"] * 6
    src.write_text("\n".join(words) + "\n")
    tgt.write_text("\n".join(w.replace("ein", "a").replace("der", "the") for w in words) + "\n")
    cfg = {
        "model": {
            "arch": "encoder_decoder",
            "scheme": "deepnorm",
            "layers": 1,
            "decoder_layers": 1,
            "width": 32,
            "heads": 2,
            "ffn": 64,
            "vocab_size": 262,
            "max_len": 24,
        },
        "objective": {"name": "seq2seq"},
        "data": {"name": "parallel", "options": {"source": str(src), "target": str(tgt), "valid_percent": 10}},
        "train": {"steps": 2, "batch_size": 4},
    }
    train(cfg, tmp_path / "run", quiet=True)
    ev = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert ev["split"] == "eval" and 0.0 <= ev["bleu"] <= 100.0
    assert sorted(json.loads((tmp_path / "run" / "baselines.json").read_text())["baselines"]) == ["copy", "nearest"]
    tgt.write_text("only one line\n")
    with pytest.raises(InputError, match="lines, but"):
        train(cfg, tmp_path / "run2", quiet=True)


def test_cli_main_returns_exit_code(tmp_path, capsys):
    rc = main(
        ["train", str(ROOT / "configs" / "stdlib_gpt.yaml"), "--out", str(tmp_path / "r"), "--set", "model.scheme=nope"]
    )
    assert rc == 2
    assert "model.scheme='nope'" in capsys.readouterr().err


def test_synthetic_tasks_are_what_they_say():
    from kilolayer.data import load_source

    for task in ("copy", "reverse", "sort", "add"):
        cfg = load_config(
            {**TINY_S2S, "data": {"name": "synthetic", "task": task}, "model": {**TINY_S2S["model"], "max_len": 40}}
        )
        src = load_source(cfg)
        b = src.train_batch(3, 6)
        for i in range(6):
            x = b["src"][i][~b["src_padding_mask"][i]].tolist()
            y = b["tgt_out"][i][~b["tgt_padding_mask"][i]].tolist()
            assert y[-1] == src.eos and b["tgt_in"][i][0] == src.bos
            y = y[:-1]
            if task == "copy":
                assert y == x
            elif task == "reverse":
                assert y == x[::-1]
            elif task == "sort":
                assert y == sorted(x)
            else:
                text = "".join(src.symbol(t) for t in x)
                a, c = text.split("+")
                assert "".join(src.symbol(t) for t in y) == str(int(a) + int(c))
        # the same step gives the same batch; a rank's share is a slice of the global batch
        again = src.train_batch(3, 6)
        assert torch.equal(again["src"], b["src"])
        half = src.train_batch(3, 6, rank=1, world=2)
        assert half["src"].shape[0] == 3


def test_fast_path_switches_track_the_reference(tmp_path):
    """train.fused_optimizer matches foreach AdamW to float rounding; bf16 autocast stays within 2%."""
    ref = train(TINY_LM, tmp_path / "ref", quiet=True, sets=["train.steps=3"])
    fused = train(TINY_LM, tmp_path / "fused", quiet=True, sets=["train.steps=3", "train.fused_optimizer=true"])
    bf16 = train(TINY_LM, tmp_path / "bf16", quiet=True, sets=["train.steps=3", "train.precision=bf16"])
    assert ref == fused == bf16
    a, b, c = losses(tmp_path / "ref"), losses(tmp_path / "fused"), losses(tmp_path / "bf16")
    assert [x for _, x in b] == pytest.approx([x for _, x in a], rel=1e-5)
    assert [x for _, x in c] == pytest.approx([x for _, x in a], rel=2e-2)
