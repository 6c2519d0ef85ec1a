"""seq2seq's evaluation scores and the baselines they sit beside: token accuracy counted by hand, sacrebleu's BLEU
and chrF with bootstrap intervals (an oracle's are 100 with no width; an interval holds its point and narrows with
more pairs; nothing is drawn from the global random state), the copy and nearest-neighbour baselines equal to
sacrebleu on the same pairs, the verdict against the nearest one, and ``kilolayer evaluate``."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
from objective_helpers import TINY_IMAGE
from torch import nn

from kilolayer import rundir
from kilolayer.cli import main
from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.data import parallel as P
from kilolayer.errors import InputError
from kilolayer.objectives import build_task
from kilolayer.objectives.baselines import baseline_scores, shuffle_hypotheses, translates
from kilolayer.objectives.text_scores import text_scores
from kilolayer.train.logging import eval_line
from kilolayer.train.score import score_run

MODEL = {"arch": "encoder_decoder", "layers": 1, "decoder_layers": 1, "width": 32, "heads": 2, "ffn": 64}
SCORES = {f"{m}{end}" for m in ("bleu", "chrf", "exact_match") for end in ("", "_low", "_high")}


def synthetic(task="reverse", **options):
    return load_config(
        {
            "model": {**MODEL, "vocab_size": 13, "max_len": 16},
            "objective": {"name": "seq2seq", "options": options},
            "data": {"name": "synthetic", "task": task, "options": {"min_len": 3, "max_len": 8, "eval_size": 24}},
            "train": {"steps": 0},
        }
    )


# ------------------------------------------------------------------ token accuracy


class Guess(nn.Module):
    """A head whose argmax is a fixed tensor of ids, whatever it is given."""

    def __init__(self, ids: torch.Tensor, vocab: int):
        super().__init__()
        self.logits = nn.functional.one_hot(ids, vocab).float()

    def forward(self, h):
        return self.logits[: h.shape[0], : h.shape[1]]


def test_token_accuracy_counts_the_target_tokens_the_loss_counts():
    cfg = synthetic(decode_samples=0)
    source = load_source(cfg)
    task = build_task(cfg, source).eval()
    batch = source.batch_of([([3, 4, 5], [5, 4, 3]), ([6], [6]), ([3, 3, 4, 5], [5, 4, 3, 3])])
    # targets with their end token (2): [5 4 3 2 .], [6 2 . . .], [5 4 3 3 2]; padding is 0
    guess = batch["tgt_out"].clone()
    guess[0, 1] = 7  # wrong
    guess[1, 1] = 9  # the end token wrong
    guess[1, 2:] = 0  # the padding "right": not counted
    guess[2, 4] = 4  # the end token wrong
    task.objective.head = Guess(guess, 13)
    out = task.objective.evaluate(task.backbone, [batch])
    assert out["token_accuracy"] == pytest.approx(8 / 11)  # 3 of 4, 1 of 2, 4 of 5
    assert set(out) == {"loss", "token_accuracy"}  # decode_samples 0: nothing decoded


# ------------------------------------------------------------------ scores and their intervals


def test_an_oracle_decoder_scores_100_with_an_interval_of_no_width():
    cfg = synthetic()
    source = load_source(cfg)
    task = build_task(cfg, source).eval()
    batches = list(source.eval_batches(10))  # 10 + 10 + 4 pairs, all decoded
    queue = [b["tgt_out"].masked_fill(b["tgt_padding_mask"], source.eos) for b in batches]
    task.objective.greedy = lambda *a, **k: queue.pop(0)
    out = task.objective.evaluate(task.backbone, batches)
    assert not queue
    assert SCORES <= out.keys()
    for name, best in (("bleu", 100.0), ("chrf", 100.0), ("exact_match", 1.0)):
        assert out[name] == out[f"{name}_low"] == out[f"{name}_high"] == pytest.approx(best)


def noisy(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` references of 4-12 digits, and hypotheses with each digit wrong with probability 0.3."""
    g = random.Random(seed)
    refs = [" ".join(str(g.randrange(10)) for _ in range(g.randint(4, 12))) for _ in range(n)]
    hyps = [" ".join(c if g.random() > 0.3 else str(g.randrange(10)) for c in r.split()) for r in refs]
    return hyps, refs


def test_an_interval_holds_its_point_and_narrows_with_more_pairs():
    few, many = text_scores(*noisy(40)), text_scores(*noisy(640))
    for name in ("bleu", "chrf", "exact_match"):
        for s in (few, many):
            assert s[f"{name}_low"] < s[name] < s[f"{name}_high"], (name, s)
        width = {k: s[f"{name}_high"] - s[f"{name}_low"] for k, s in (("few", few), ("many", many))}
        # 16 times the pairs: about a quarter of the width
        assert width["many"] < 0.5 * width["few"], (name, width)
    hyps, refs = noisy(640)
    assert many["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert many["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert many["exact_match"] == sum(h == r for h, r in zip(hyps, refs)) / 640


def test_the_interval_is_the_same_each_time_and_leaves_the_global_random_state_alone():
    torch.manual_seed(5)
    np.random.seed(5)
    before = torch.get_rng_state(), np.random.get_state()[1].copy()
    first = text_scores(*noisy(50))
    assert torch.equal(torch.get_rng_state(), before[0]) and (np.random.get_state()[1] == before[1]).all()
    assert text_scores(*noisy(50)) == first


# ------------------------------------------------------------------ baselines

# each validation source is a training source with one word changed: its nearest neighbour is that pair
TRAIN = [
    ("der rote Hund schläft im Garten", "the red dog sleeps in the garden"),
    ("die kleine Katze trinkt Milch", "the little cat drinks milk"),
    ("mein Vater liest die Zeitung", "my father reads the newspaper"),
    ("wir fahren morgen nach Berlin", "we drive to Berlin tomorrow"),
    ("das Wetter ist heute schön", "the weather is nice today"),
    ("ich habe keinen Hunger mehr", "I am not hungry any more"),
    ("öffnen Sie bitte das Fenster", "please open the window"),
    ("der Zug kommt um acht Uhr", "the train arrives at eight o'clock"),
    ("sie spielt jeden Tag Klavier", "she plays the piano every day"),
    ("speichern Sie das Dokument", "save the document"),
    ("wählen Sie eine Tabelle aus", "select a table"),
    ("klicken Sie auf Abbrechen", "click Cancel"),
]
VALID = [
    ("der rote Hund schläft im Haus", "the red dog sleeps in the house", 0),
    ("mein Vater liest das Buch", "my father reads the book", 2),
    ("der Zug kommt um neun Uhr", "the train arrives at nine o'clock", 7),
    ("speichern Sie die Tabelle", "save the table", 9),
]


@pytest.fixture
def parallel_files(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    rows = [(s, t) for s, t, _ in VALID] + TRAIN  # the parallel source holds out its first lines
    (tmp_path / "de.txt").write_text("".join(s + "\n" for s, _ in rows), encoding="utf-8")
    (tmp_path / "en.txt").write_text("".join(t + "\n" for _, t in rows), encoding="utf-8")
    opts = {"source": str(tmp_path / "de.txt"), "target": str(tmp_path / "en.txt"), "valid_percent": 25}
    return load_config(
        {
            "model": {**MODEL, "vocab_size": 262, "max_len": 48},
            "objective": {"name": "seq2seq"},
            "data": {"name": "parallel", "options": opts},
            "train": {"steps": 0, "batch_size": 3},
        }
    )


def test_copy_and_nearest_baselines_are_sacrebleu_on_the_same_pairs(parallel_files):
    source = load_source(parallel_files)
    assert len(source.valid) == 4 and source.baselines == ("copy", "nearest")
    found = baseline_scores(source, source.valid)
    refs = [t for _, t, _ in VALID]
    expect = {"copy": [s for s, _, _ in VALID], "nearest": [TRAIN[j][1] for _, _, j in VALID]}
    for name, hyps in expect.items():
        assert found[name]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
        assert found[name]["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
        assert found[name]["exact_match"] == 0.0
    assert 20 < found["nearest"]["bleu"] < 100 and found["copy"]["bleu"] < found["nearest"]["bleu"]
    # the objective finds the same pairs in the evaluation batches (3 + 1 rows), and the same scores
    task = build_task(parallel_files, source)
    assert task.objective.baselines(source.eval_batches(3)) == {"pairs": 4, "baselines": found}


def test_shuffle_keeps_the_references_tokens_and_token_accuracy_is_by_position():
    source = load_source(synthetic(task="sort"))
    pairs = source.eval_pairs
    found = baseline_scores(source, pairs)
    assert sorted(found) == ["copy", "shuffle"]
    refs = [source.detokenize(t) for _, t in pairs]
    shuffled = shuffle_hypotheses(source, pairs)
    assert all(sorted(h) == sorted(t) for h, (_, t) in zip(shuffled, pairs))
    assert sum(h != t for h, (_, t) in zip(shuffled, pairs)) > len(pairs) // 2
    for name, ids in (("copy", [s for s, _ in pairs]), ("shuffle", shuffled)):
        hyps = [source.detokenize(h) for h in ids]
        assert found[name]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
        assert found[name]["exact_match"] == sum(h == r for h, r in zip(hyps, refs)) / len(pairs)
        # by position, each target's end token (2) included
        right = sum(a == b for h, (_, t) in zip(ids, pairs) for a, b in zip(h + [2], t + [2]))
        assert found[name]["token_accuracy"] == pytest.approx(right / sum(len(t) + 1 for _, t in pairs))


def test_translates_only_above_the_nearest_and_copy_baselines_on_both_scores():
    base = {"copy": {"bleu": 6.3, "chrf": 22.5}, "nearest": {"bleu": 14.3, "chrf": 31.0}}
    below = translates({"bleu": 9.0, "chrf": 33.0}, base)
    assert not below.translates and below.bleu_margin == pytest.approx(-5.3) and below.chrf_margin == pytest.approx(2)
    above = translates({"bleu": 20.0, "chrf": 40.0}, base)
    assert above.translates and above.as_dict()["bleu_margin"] == pytest.approx(5.7)
    assert str(above).startswith("translates: BLEU 20.00 vs 14.30 (+5.70), chrF 40.00 vs 31.00 (+9.00)")
    # where the target is close to the source, copying is the bar: a model that copies does not translate
    close = {"copy": {"bleu": 85.8, "chrf": 97.0}, "nearest": {"bleu": 10.3, "chrf": 31.2}}
    copier = translates({"bleu": 85.8, "chrf": 97.0}, close)
    assert not copier.translates and (copier.bar_bleu, copier.bar_chrf) == (85.8, 97.0)
    assert translates({"bleu": 86.0, "chrf": 97.5}, close).translates
    assert translates({"bleu": 20.0, "chrf": 40.0}, {"copy": base["copy"]}) is None  # no nearest neighbour
    assert translates({"loss": 1.0}, base) is None  # nothing decoded
    line = eval_line("eval step 5", {"loss": 2.5, "bleu": 9.0, "bleu_low": 8.0, "bleu_high": 10.0, "chrf": 33.0}, base)
    assert line == (
        "eval step 5: loss 2.5 bleu 9 [8, 10] chrf 33 | copy: bleu 6.3 chrf 22.5 | nearest: bleu 14.3 chrf 31 | "
        f"{below}"
    )


# ------------------------------------------------------------------ kilolayer evaluate

RUN = {
    "model": {**MODEL, "vocab_size": 13, "max_len": 16},
    "objective": {"name": "seq2seq"},
    "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 8, "eval_size": 20}},
    "train": {"steps": 6, "batch_size": 8, "lr": 1e-3, "eval_every": 3, "log_every": 3, "peak_flops": 1e12},
}


def test_a_run_scored_again_gives_its_last_evaluation_and_baselines(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run(RUN), run)
    record = score_run(run, device="cpu")
    assert json.loads((run / "scores_validation.json").read_text()) == record
    assert (record["data"], record["split"], record["samples"], record["step"]) == ("synthetic", "validation", 20, 6)
    assert record["checkpoint"] == "step_00000006" and "translates" not in record
    # 3 batches of 8 cover the 20 pairs: the run's last evaluation scored exactly these
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["metrics"] == pytest.approx({k: v for k, v in last.items() if k not in ("step", "split")})
    assert record["metrics"].keys() == {"loss", "token_accuracy", *SCORES}
    # the training-time baselines, and beside each the model's paired difference from it on the same pairs
    saved = json.loads((run / "baselines.json").read_text())["baselines"]
    paired = {name: scores.pop("model_minus") for name, scores in record["baselines"].items()}
    assert record["baselines"] == saved and set(paired) == set(saved)
    assert all(math.isfinite(v) for b in record["baselines"].values() for v in b.values())
    for name, d in paired.items():
        assert d["bleu"] == pytest.approx(record["metrics"]["bleu"] - saved[name]["bleu"])
        assert d["chrf_low"] <= d["chrf"] <= d["chrf_high"]


def test_scoring_bad_input_is_one_line(trained_run, tmp_path):
    run = trained_run(RUN)
    with pytest.raises(InputError, match=r"^--split test: data.name='synthetic' has no test split"):
        score_run(run, "test", device="cpu")
    with pytest.raises(InputError, match=r"^--split train: expected one of validation, test$"):
        score_run(run, "train", device="cpu")
    with pytest.raises(InputError, match="not a kilolayer run directory"):
        score_run(tmp_path, device="cpu")
    (tmp_path / "config.yaml").write_text((run / "config.yaml").read_text())
    with pytest.raises(InputError, match="has no complete checkpoint"):
        score_run(tmp_path, device="cpu")


def test_cli_evaluate_writes_the_scores_and_refuses_a_missing_split(trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run(RUN), run)
    assert main(["evaluate", str(run), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("validation (20 samples, step_00000006): loss ")
    assert "| copy: bleu " in out and "| shuffle: bleu " in out
    assert json.loads((run / "scores_validation.json").read_text())["metrics"].keys() >= SCORES
    assert main(["evaluate", str(run), "--split", "test"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kilolayer: error: --split test: data.name='synthetic' has no test split")
    with pytest.raises(SystemExit) as stopped:
        main(["evaluate", str(run), "--split", "dev"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "invalid choice: 'dev'" in err and len(err.strip().splitlines()) == 1, err


def test_the_first_samples_are_scored_in_whole_batches_and_never_replace_a_larger_score(trained_run, tmp_path, capsys):
    """--samples 10 scores the first 16 pairs (2 batches of 8) of the 20: the loss, the decoded scores and the
    baselines all read the pairs that a run evaluating 2 batches read, so they equal its last evaluation and its
    baselines; a later request for fewer is refused, one for all replaces it."""
    run = tmp_path / "run"
    shutil.copytree(trained_run({**RUN, "train": {**RUN["train"], "eval_batches": 2}}), run)
    part = score_run(run, device="cpu", samples=10)
    assert (part["samples"], part["of"], part["step"]) == (16, 20, 6)
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert part["metrics"] == pytest.approx({k: v for k, v in last.items() if k not in ("step", "split")})
    paired = {name: scores.pop("model_minus") for name, scores in part["baselines"].items()}
    assert part["baselines"] == json.loads((run / "baselines.json").read_text())["baselines"] and paired
    with pytest.raises(InputError) as refused:
        score_run(run, device="cpu", samples=3)
    assert str(refused.value) == (
        f"--samples 3: {run / 'scores_validation.json'} holds a score of 16 samples of the same checkpoint "
        "(step_00000006), more than the 8 (3 rounded up to whole batches of 8) asked for; move it away to replace it"
    )
    # a score of an older checkpoint (the run resumed since) is replaced by a part of the standing one's
    stale = json.loads((run / "scores_validation.json").read_text())
    rundir.write_json(run / "scores_validation.json", {**stale, "checkpoint": "step_00000003", "step": 3})
    assert score_run(run, device="cpu", samples=8)["samples"] == 8
    assert main(["evaluate", str(run), "--device", "cpu", "--samples", "16"]) == 0
    assert capsys.readouterr().out.startswith("validation (16 of 20 samples, step_00000006): loss ")
    full = score_run(run, device="cpu", samples=100)  # at least the split: every pair, as without --samples
    assert (full["samples"], "of" in full) == (20, False)
    assert full["metrics"]["loss"] != pytest.approx(part["metrics"]["loss"], abs=1e-6)
    for bad in (0, -2, True, 2.5):
        with pytest.raises(InputError, match=rf"^--samples {bad}: expected a whole number of samples, at least 1$"):
            score_run(run, device="cpu", samples=bad)


def test_a_contrastive_run_is_scored_on_every_sample(trained_run):
    """Recall ranks a sample among those scored: a part of the split is refused, in one line."""
    cfg = {
        "model": TINY_IMAGE,
        "objective": {"name": "contrastive", "options": {"embed_dim": 16, "text_model": {"layers": 1, "width": 32}}},
        "data": {"name": "digit_captions"},
        "train": {"steps": 2, "batch_size": 16, "eval_every": 2, "log_every": 2, "peak_flops": 1e12},
    }
    with pytest.raises(InputError, match=r"^--samples 16: contrastive recall ranks each sample among those scored"):
        score_run(trained_run(cfg), device="cpu", samples=16)


def _de_en_extracted() -> bool:
    root = Path(os.environ.get(P.ENV_ROOT) or P.default_root())
    return all((root / marker).exists() for marker in P.all_packages("de_en").values())


@pytest.mark.slow
@pytest.mark.skipif(
    not _de_en_extracted(), reason="the de_en packages are not extracted (python -m kilolayer.data.debian fetch de_en)"
)
def test_on_de_en_the_nearest_training_target_beats_copying_the_german():
    cfg = load_config(
        {
            "model": {**MODEL, "vocab_size": 8000, "max_len": 128},
            "objective": {"name": "seq2seq"},
            "data": {"name": "de_en", "options": {"vocab": 8000}},
            "train": {"steps": 0},
        }
    )
    source = load_source(cfg)
    pairs = source.splits["validation"][:256]
    found = baseline_scores(source, pairs)
    refs = [source.detokenize(t) for _, t in pairs]
    copy = [source.detokenize(s) for s, _ in pairs]
    assert found["copy"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(copy, [refs]).score, abs=1e-9)
    # retrieval is far above copying, and its interval clears copy's
    assert found["nearest"]["bleu_low"] > found["copy"]["bleu_high"]
    assert found["nearest"]["chrf_low"] > found["copy"]["chrf_high"]


DIGITS_CLASSIFIER = {  # a tiny classifier on digits, a source with a test split
    "model": TINY_IMAGE,
    "objective": {"name": "classification"},
    "data": {"name": "digits"},
    "train": {"steps": 2, "batch_size": 16, "peak_flops": 1e12},
}


def test_any_objective_is_scored_on_its_test_split(trained_run, tmp_path):
    """A digits classifier: the metrics of its evaluations over all of the test split, and no baselines."""
    cfg = DIGITS_CLASSIFIER
    run = tmp_path / "run"
    shutil.copytree(trained_run(cfg), run)
    record = score_run(run, "test", device="cpu")
    source = load_source(load_config({**cfg, "data": {"name": "digits", "options": {"eval_split": "test"}}}))
    assert (record["split"], record["samples"]) == ("test", source.eval_size)
    assert record["metrics"].keys() == {"loss", "accuracy"} and 0 <= record["metrics"]["accuracy"] <= 1
    assert "baselines" not in record and not (run / "baselines.json").exists()
    assert (run / "scores_test.json").is_file()


def test_a_studys_final_table_reads_the_test_scores_analysis(trained_run, tmp_path):
    """The ``test_scores`` analysis is ``kilolayer evaluate --split test`` kept with the point; the study's
    result then carries it, and a BLEU table reads its scores and its baselines, not the validation ones."""
    from kilolayer.study.analyses import run_analysis
    from kilolayer.study.runner import Result, collect
    from kilolayer.verdicts.claims import _split
    from kilolayer.verdicts.measures import MEASURES

    cfg = DIGITS_CLASSIFIER
    run = tmp_path / "run"
    shutil.copytree(trained_run(cfg), run)
    run_analysis("test_scores", run)
    saved = json.loads((run / "analysis" / "test_scores" / "test_scores.json").read_text())
    assert saved == json.loads((run / "scores_test.json").read_text())
    assert saved["split"] == "test"

    class Point:  # what collect() asks of a point
        group, name, config = "g", "p", None

        def run_dir(self, out):
            return run

    assert collect(Point(), tmp_path).test == saved

    val = {"loss": 1.0, "bleu": 30.0, "chrf": 50.0}
    test = {"samples": 7, "metrics": {"loss": 1.5, "bleu": 12.0, "chrf": 40.0}}
    test["baselines"] = {"nearest": {"bleu": 15.0, "chrf": 41.0}}
    r = Result(point=Point(), status="completed", eval=val, test=test)
    bleu = MEASURES["bleu"]
    assert bleu.read(r, tmp_path, "test") == 12.0 and bleu.read(r, tmp_path, "validation") == 30.0
    note = bleu.note([r], tmp_path, "test")[0]
    assert "same test pairs: nearest BLEU 15.00, chrF 41.00" in note and "0 of 1 completed runs translate" in note
    without = Result(point=Point(), status="completed", eval=val)
    # one split for all: where the groups do not score test, a run without test scores puts every run of the
    # comparison on validation; where they do, test is read and the run without it is not evidence
    from types import SimpleNamespace

    plain, scored = SimpleNamespace(analyses=set()), SimpleNamespace(analyses={"test_scores"})
    assert _split(bleu, [r, r], plain) == "test" and _split(bleu, [r, without], plain) == "validation"
    assert _split(bleu, [r, without], scored) == "test"


def test_a_paired_bootstrap_compares_model_and_baseline_on_the_same_sentences():
    from kilolayer.objectives.text_scores import paired_difference, text_scores

    refs = [f"the cat sat on mat number {i} today" for i in range(40)]
    same = paired_difference(refs, refs, refs)
    assert same["bleu"] == same["bleu_low"] == same["bleu_high"] == 0.0  # identical hypotheses: no difference
    # the model gets 30 sentences right, the baseline 25 of those same ones: a small, consistent advantage
    model = [r if i < 30 else "a dog" for i, r in enumerate(refs)]
    other = [r if i < 25 else "a dog" for i, r in enumerate(refs)]
    d = paired_difference(model, other, refs)
    a, b = text_scores(model, refs), text_scores(other, refs)
    assert d["bleu"] == pytest.approx(a["bleu"] - b["bleu"]) and d["chrf"] == pytest.approx(a["chrf"] - b["chrf"])
    assert 0 < d["chrf_low"] <= d["chrf"] <= d["chrf_high"]
    # pairing removes the spread both share: the paired interval is narrower than the two separate ones combined
    assert d["chrf_high"] - d["chrf_low"] < (a["chrf_high"] - a["chrf_low"]) + (b["chrf_high"] - b["chrf_low"])
    with pytest.raises(ValueError, match="hypotheses for"):
        paired_difference(model[:3], other, refs)


def test_the_interval_is_scipys_percentile_bootstrap():
    """The NumPy interval draws what scipy.stats.bootstrap draws from the same generator and takes the same
    quantiles (NumPy's linear interpolation, written as scipy's to within float rounding), for a vector statistic
    of 37 sentences and of 2."""
    from scipy.stats import bootstrap

    from kilolayer.objectives.text_scores import RESAMPLES, SEED, _interval

    values = np.random.default_rng(3).normal(size=(37, 2))
    statistic = lambda rows: np.array([values[rows, 0].mean(), np.median(values[rows, 1])])
    for n in (37, 2):
        point, low, high = _interval(statistic, n)
        found = bootstrap(
            (np.arange(n),),
            statistic,
            n_resamples=RESAMPLES,
            vectorized=False,
            method="percentile",
            rng=np.random.default_rng(SEED),
        ).confidence_interval
        assert point.tolist() == statistic(np.arange(n)).tolist()
        assert low == pytest.approx(found.low, rel=1e-12) and high == pytest.approx(found.high, rel=1e-12)
        assert low[0] < point[0] < high[0]


def test_translates_by_the_paired_interval_when_the_baselines_hold_it():
    base = {"copy": {"bleu": 6.3, "chrf": 22.5}, "nearest": {"bleu": 18.1, "chrf": 33.7}}
    metrics = {"bleu": 18.7, "chrf": 38.3}  # above both baselines as point estimates
    assert translates(metrics, base).translates and not translates(metrics, base).paired
    noisy = {
        "copy": {**base["copy"], "model_minus": {"bleu_low": 11.0, "chrf_low": 14.0}},
        "nearest": {**base["nearest"], "model_minus": {"bleu_low": -0.2, "chrf_low": 3.1}},
    }
    v = translates(metrics, noisy)  # BLEU's advantage over the nearest pair's target is inside the noise
    assert v.paired and not v.translates and v.low_bleu_margin == pytest.approx(-0.2)
    assert "paired bootstrap on the same sentences" in str(v) and v.low_chrf_margin == pytest.approx(3.1)
    noisy["nearest"]["model_minus"]["bleu_low"] = 0.4
    assert translates(metrics, noisy).translates
