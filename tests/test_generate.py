"""kilolayer.load, generation (greedy, sampling, beam search), export, and `kilolayer generate` / `export`."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from objective_helpers import WHOLE_TASKS, tiny_lm

import kilolayer
from kilolayer.cli import main
from kilolayer.errors import ConfigError
from kilolayer.objectives.decoding import Decoding
from kilolayer.rundir import chosen_checkpoint
from kilolayer.train.checkpoint import read_weights
from tests.helpers import ROOT

LM = tiny_lm(steps=20, batch_size=8, lr=3e-3, log_every=10, eval_every=20, checkpoint_every=20)
REVERSE = {
    "model": {
        "arch": "encoder_decoder",
        "layers": 2,
        "decoder_layers": 2,
        "width": 32,
        "heads": 4,
        "ffn": 64,
        "vocab_size": 16,
        "max_len": 24,
    },
    "objective": {"name": "seq2seq", "options": {"decode_samples": 8}},
    "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 8, "eval_size": 16}},
    "train": {"steps": 60, "batch_size": 16, "lr": 3e-3, "log_every": 30, "eval_every": 60, "checkpoint_every": 60},
}
MAE = {**WHOLE_TASKS["mae"], "train": {"steps": 2, "batch_size": 8, "eval_every": 2, "checkpoint_every": 2}}


@pytest.fixture
def lm(trained_run):
    return trained_run(LM)


@pytest.fixture
def reverse(trained_run):
    return trained_run(REVERSE)


def sources(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(3, 13, (int(k),), generator=g)).tolist() for k in torch.randint(3, 9, (n,), generator=g)]


def target_logprob(trained, src: list[int], out: list[int]) -> float:
    """log p(out + EOS | src) under the model, teacher-forced."""
    bos, eos = trained.codec.bos, trained.codec.eos
    logits = trained.logits(torch.tensor([src]), torch.tensor([[bos] + out]))
    return float(logits.log_softmax(-1)[0].gather(-1, torch.tensor([out + [eos]]).T).sum())


def test_load_gives_the_runs_standing_weights_and_its_data_codec(lm):
    trained = kilolayer.load(lm)
    ckpt = chosen_checkpoint(lm)
    weights = read_weights(ckpt / "model.safetensors")
    assert trained.step == 20 and not trained.task.training
    assert all(torch.equal(v, weights[k]) for k, v in trained.task.state_dict().items())
    assert trained.encode("def f():") == list(b"def f():") and trained.decode(list(b"x = 1") + [258, 65]) == "x = 1"


def test_greedy_writes_the_most_likely_token_at_each_step(lm):
    trained = kilolayer.load(lm)
    prompt = trained.encode("import os\n")
    out = trained.generate_ids(prompt, max_new_tokens=12)
    assert len(out) == 12 and trained.generate_ids(prompt, max_new_tokens=12) == out
    logits = trained.logits(torch.tensor([prompt + out]))[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out
    # past model.max_len (32) the model reads the last 32 ids
    assert len(trained.generate_ids(prompt, max_new_tokens=40)) == 40


def test_sampling_with_a_seed_is_reproducible_and_stays_in_the_top_k(lm):
    trained = kilolayer.load(lm)
    prompt = trained.encode("class A:\n")
    draw = dict(max_new_tokens=20, temperature=3.0, top_k=3)
    out = trained.generate_ids(prompt, seed=1, **draw)
    assert trained.generate_ids(prompt, seed=1, **draw) == out
    assert trained.generate_ids(prompt, seed=2, **draw) != out
    logits = trained.logits(torch.tensor([prompt + out]))[0, len(prompt) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(tok in row for tok, row in zip(out, top3.tolist()))
    # at this temperature the draws are not all greedy's
    assert out != trained.generate_ids(prompt, max_new_tokens=20)


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(400, 1)
    g = torch.Generator().manual_seed(0)
    assert set(Decoding(top_p=0.7).pick(logits, g).tolist()) == {0, 1}
    assert set(Decoding(top_p=0.5).pick(logits, g).tolist()) == {0}
    assert set(Decoding(top_p=0.81).pick(logits, g).tolist()) == {0, 1, 2}
    assert set(Decoding(top_k=2, temperature=1.0).pick(logits, g).tolist()) == {0, 1}
    assert Decoding().pick(logits[:1]).tolist() == [0]


def test_one_beam_is_greedy_and_more_beams_score_at_least_as_well(reverse):
    trained = kilolayer.load(reverse)
    differ = 0
    for src in sources():
        greedy = trained.generate_ids(src)
        assert trained.generate_ids(src, beams=1) == greedy
        beam = trained.generate_ids(src, beams=4, length_penalty=0.0)
        assert target_logprob(trained, src, beam) >= target_logprob(trained, src, greedy) - 1e-5
        differ += beam != greedy
    assert differ >= 2  # the search is not greedy's in disguise
    text = trained.generate("3 1 4 1 5")
    assert text == trained.decode(trained.generate_ids(trained.encode("3 1 4 1 5")))
    assert trained.encode("31415") == trained.encode("3 1 4 1 5") == [6, 4, 7, 4, 8]


def test_an_export_loads_without_the_run_and_gives_the_same_logits(reverse, lm, tmp_path):
    for run, inputs in (
        (reverse, (torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 8, 7]]))),
        (lm, (torch.tensor([list(b"def ")]),)),
    ):
        copy = tmp_path / run.parent.name
        shutil.copytree(run, copy)
        before = kilolayer.load(copy)
        out = before.export(tmp_path / f"{copy.name}_export")
        shutil.rmtree(copy)
        after = kilolayer.load(out)
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", "tokenizer.json"]
        assert torch.equal(after.logits(*inputs), before.logits(*inputs))
        prompt = "8 7 6 5" if run == reverse else "def "
        assert after.generate(prompt) == before.generate(prompt)


def test_a_model_of_images_exports_and_loads_back(trained_run, tmp_path):
    run = trained_run(MAE)
    out = kilolayer.load(run).export(tmp_path / "mae")
    after, before = kilolayer.load(out), kilolayer.load(run)
    assert after.codec is None
    assert all(torch.equal(v, before.task.state_dict()[k]) for k, v in after.task.state_dict().items())


def test_generate_prints_what_the_library_writes(reverse, lm, capsys):
    assert main(["generate", str(reverse), "--prompt", "3 1 4 1 5", "--beams", "3"]) == 0
    assert capsys.readouterr().out == kilolayer.load(reverse).generate("3 1 4 1 5", beams=3) + "\n"
    assert main(["generate", str(lm), "--prompt", "def ", "--top-k", "5", "--seed", "3", "--max-new-tokens", "9"]) == 0
    assert capsys.readouterr().out == kilolayer.load(lm).generate("def ", top_k=5, seed=3, max_new_tokens=9) + "\n"


@pytest.mark.parametrize(
    "args, named",
    [
        (["generate", "{missing}", "--prompt", "1 2"], "neither a kilolayer run directory nor an export"),
        (["generate", "{mae}", "--prompt", "1 2"], "objectives that do: causal_lm, seq2seq"),
        (["generate", "{lm}", "--prompt", "x", "--top-k", "0"], "top_k=0"),
        (["generate", "{lm}", "--prompt", "x", "--beams", "2"], "beams=2"),
        (["generate", "{lm}", "--prompt", "", "--max-new-tokens", "3"], "prompt"),
        (["generate", "{reverse}", "--prompt", "3 1 x"], "prompt: 'x'"),
        (["generate", "{reverse}", "--prompt", "3 1", "--temperature", "0.5"], "temperature"),
        (["generate", "{lm}", "--prompt", "x", "--temperature", "inf"], "temperature=inf: expected a finite number"),
        (["export", "{lm}", "--out", "{lm}"], "--out"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(args, named, trained_run, tmp_path, capsys):
    paths = {
        "missing": tmp_path / "nope",
        "mae": trained_run(MAE),
        "lm": trained_run(LM),
        "reverse": trained_run(REVERSE),
    }
    assert main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kilolayer: error:") and named in err


@pytest.mark.integration
def test_the_commands_run_as_a_user_types_them(reverse, tmp_path):
    out = tmp_path / "export"
    kilolayer_cmd = [sys.executable, "-m", "kilolayer"]
    subprocess.run([*kilolayer_cmd, "export", str(reverse), "--out", str(out)], check=True, capture_output=True)
    done = subprocess.run(
        [*kilolayer_cmd, "generate", str(out), "--prompt", "3 1 4 1 5"], check=True, capture_output=True, text=True
    )
    assert done.stdout == kilolayer.load(reverse).generate("3 1 4 1 5") + "\n"


def test_every_codec_reads_back_from_an_export_folder(tmp_path):
    pytest.importorskip("tokenizers")
    from kilolayer.data.codec import ByteCodec, SymbolCodec, TokenizerCodec, read_codec
    from kilolayer.data.parallel import train_tokenizer

    bpe = train_tokenizer(["Das Haus ist rot.", "The house is red.", "Ein rotes Haus."] * 5, vocab=60)
    words = SymbolCodec({0: "the", 1: "<unk>", 2: "<eos>", 3: "cat"}, eos=2, pad=4, unk=1)
    cases = [
        (SymbolCodec({3: "0", 4: "1", 5: "+"}, bos=1, eos=2, pad=0), "10+1", [4, 3, 5, 4], "1 0 + 1"),
        (words, "the dog cat", [0, 1, 3], "the <unk> cat"),
        (ByteCodec(), "é!", [195, 169, 33], "é!"),
        (TokenizerCodec(bpe, bos=1, eos=2, pad=0, last_special=2), "Das Haus", bpe.encode("Das Haus").ids, "Das Haus"),
    ]
    for i, (codec, text, ids, back) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        codec.save(folder)
        loaded = read_codec(folder)
        assert loaded.encode(text) == codec.encode(text) == ids
        assert loaded.decode(ids + [codec.eos, ids[0]]) == codec.decode(ids) == back
        assert loaded.specials() == codec.specials()


def test_a_model_of_data_with_no_text_vocabulary_asks_for_token_ids(tmp_path, monkeypatch, capsys):
    # the example plug-in's source: random ids below 16, no tokenizer of its own and too few ids for bytes
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugin"))
    from kilolayer_example_plugin.source import repeat

    from kilolayer.data import SOURCES
    from kilolayer.train.run import train

    config = {
        "model": {"arch": "decoder", "layers": 1, "width": 16, "heads": 2, "ffn": 32, "vocab_size": 16, "max_len": 16},
        "objective": {"name": "causal_lm"},
        "data": {"name": "repeat_ids", "options": {"half": 4, "train_size": 32, "eval_size": 8}},
        "train": {"steps": 1, "batch_size": 4, "eval_batches": 1},
    }
    with SOURCES.added("repeat_ids", repeat):
        train(config, tmp_path / "run", quiet=True)
        assert main(["generate", str(tmp_path / "run"), "--prompt", "3 1 4"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "this data has no text vocabulary" in err and "generate_ids" in err
        out = kilolayer.load(tmp_path / "run").generate_ids([3, 1, 4], max_new_tokens=5)
        assert len(out) == 5 and all(0 <= i < 16 for i in out)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": float("inf")}, r"^temperature=inf: expected a finite number"),
        ({"top_p": float("nan")}, r"^top_p=nan: expected a finite number"),
        ({"beams": "4"}, r"^beams='4': expected an int"),
        ({"max_new_tokens": 2.5}, r"^max_new_tokens=2.5: expected an int"),
        ({"seed": True}, r"^seed=True: expected an int"),
        ({"max_tokens": 5}, r"^max_tokens: not a decoding setting; did you mean max_new_tokens\?"),
    ],
)
def test_a_bad_decoding_setting_is_one_line_naming_it(settings, message):
    with pytest.raises(ConfigError, match=message) as e:
        Decoding.of(settings)
    assert "\n" not in str(e.value)
