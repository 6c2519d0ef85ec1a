"""The synthetic tasks' evaluation pairs never appear in training, for any seed or step."""

from __future__ import annotations

import json
import shutil

import pytest

from kilolayer.data.synthetic import FIRST, Synthetic, SyntheticOptions
from kilolayer.errors import ConfigError

TASKS = ("reverse", "copy", "sort", "add")


def pairs_of(batch: dict) -> list[tuple[tuple, tuple]]:
    """(source, target) id tuples of a seq2seq batch, padding and EOS removed."""
    src, tgt = batch["src"].tolist(), batch["tgt_out"].tolist()
    src_len = (~batch["src_padding_mask"]).sum(1).tolist()
    tgt_len = (~batch["tgt_padding_mask"]).sum(1).tolist()
    return [(tuple(s[:n]), tuple(t[: m - 1])) for s, n, t, m in zip(src, src_len, tgt, tgt_len)]


@pytest.mark.parametrize("task", TASKS)
def test_no_training_pair_is_an_evaluation_pair(task):
    for seed in range(4):
        source = Synthetic(task, SyntheticOptions(), seed)
        held_out = {(tuple(x), tuple(y)) for x, y in source.eval_pairs}
        rejected = 0
        for step in range(1000):
            train = pairs_of(source.train_batch(step, 16))
            assert len(train) == 16
            assert not held_out.intersection(train), (task, seed, step)
            rejected += source.excluded[step]
        # short strings recur: without the rejection some of these draws would have been evaluation pairs
        assert rejected > 0, (task, seed)


def test_the_streams_differ_at_every_seed():
    """Seed 0's first training batch is not its evaluation set (the streams are keyed apart)."""
    for seed in range(4):
        source = Synthetic("reverse", SyntheticOptions(), seed)
        first = pairs_of(source.train_batch(0, 16))
        evals = [(tuple(x), tuple(y)) for x, y in source.eval_pairs[:16]]
        assert first != evals


def test_the_share_rejected_is_the_share_held_out():
    """On a small space, the measured rejection rate matches the computed probability of drawing an
    evaluation input (binomial standard error ~0.004 at 20,000 draws)."""
    opts = SyntheticOptions(vocab=3, min_len=3, max_len=5, eval_size=20)
    source = Synthetic("copy", opts, 0)
    share = source.held_out_share()
    expected = sum(3.0 ** -len(x) for x in source.held_out) / 3
    assert share == pytest.approx(expected, rel=1e-12)
    drawn = rejected = 0
    for step in range(1250):
        source.train_batch(step, 16)
        rejected += source.excluded[step]
        drawn += 16 + source.excluded[step]
    assert rejected / drawn == pytest.approx(share, abs=0.02)


def test_adds_held_out_share_counts_every_length_that_can_draw_a_sum():
    """'5+7' can come from totals of 2 digits (a, b < 10) and of 3 (a < 10, b < 100): both count."""
    opts = SyntheticOptions(min_len=2, max_len=3, eval_size=1)
    source = Synthetic("add", opts, 0)
    source.held_out = {(FIRST + 5, FIRST + 10, FIRST + 7)}
    assert source.held_out_share() == pytest.approx(0.5 / 100 + 0.5 / 1000)


def test_an_evaluation_set_that_could_swallow_training_is_refused_at_every_seed():
    """The refusal rests on a bound that holds for any seed, so a study's seeds are all refused or all run."""
    opts = SyntheticOptions(vocab=2, min_len=3, max_len=3, eval_size=4)
    for seed in range(4):
        with pytest.raises(ConfigError, match=r"data.options.eval_size=4: .* up to 50% .*lower eval_size"):
            Synthetic("copy", opts, seed)
    ok = SyntheticOptions(vocab=2, min_len=3, max_len=3, eval_size=3)  # 3 of 8 inputs: at most 37.5%
    for seed in range(4):
        source = Synthetic("copy", ok, seed)
        assert source.held_out_share() <= source.held_out_bound() == 3 / 8


def test_the_evaluation_pairs_are_distinct():
    source = Synthetic("sort", SyntheticOptions(vocab=3, min_len=4, max_len=8, eval_size=100), 0)
    assert len(source.eval_pairs) == 100 == len({tuple(x) for x, _ in source.eval_pairs})


def test_a_batch_is_the_same_at_any_world_size():
    source = Synthetic("reverse", SyntheticOptions(), 3)
    whole = pairs_of(source.train_batch(7, 8))
    halves = pairs_of(source.train_batch(7, 8, 0, 2)) + pairs_of(source.train_batch(7, 8, 1, 2))
    assert whole == halves


def test_the_train_records_count_the_rejected_draws(tmp_path):
    """Each train record's eval_excluded counts the draws rejected since the previous record; together they
    are every rejection of the run (recounted from the data)."""
    from kilolayer.train.run import train

    options = {"vocab": 3, "min_len": 2, "max_len": 3, "eval_size": 6}
    config = {
        "model": {
            "arch": "encoder_decoder",
            "layers": 1,
            "decoder_layers": 1,
            "width": 16,
            "heads": 2,
            "ffn": 32,
            "vocab_size": 8,
        },
        "objective": {"name": "seq2seq", "options": {"decode_samples": 0}},
        "data": {"name": "synthetic", "task": "reverse", "options": options},
        "train": {"steps": 12, "log_every": 5, "batch_size": 8, "eval_batches": 1},
    }
    train(config, tmp_path / "run", quiet=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["eval_excluded"]) for r in records if r.get("split") == "train"]
    source = Synthetic("reverse", SyntheticOptions(**options), 0)
    counts = []
    for step in range(12):
        source.train_batch(step, 8)
        counts.append(source.excluded[step])
    assert logged == [(5, sum(counts[:5])), (10, sum(counts[5:10])), (12, sum(counts[10:]))]
    assert sum(counts) > 0

    # resumed from its step-7 checkpoint, the record of step 10 still counts batches 5 to 9: batches 5 and 6,
    # drawn before the resume, are drawn again to count them
    config["train"]["checkpoint_every"] = 7
    train(config, tmp_path / "resumed", quiet=True)
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_00000012")
    train(config, tmp_path / "resumed", resume=True, quiet=True)
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    again = [(r["step"], r["eval_excluded"]) for r in map(json.loads, lines) if r.get("split") == "train"]
    assert again == logged
