"""`kilolayer analyze smoothness --run` on tiny runs made by `kilolayer train`."""

import json
import statistics

import pytest
import torch
import yaml

from kilolayer.analysis.smoothness import high_frequency, token_cosine
from kilolayer.cli import main

checkpoint = pytest.importorskip("kilolayer.train.checkpoint")


def _train(root, name, config):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = root / name
    assert main(["train", str(path), "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train = {"steps": 2, "batch_size": 8}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        digits = _train(
            root,
            "digits_vit",
            {
                "model": {
                    "arch": "encoder",
                    "scheme": "post_ln",
                    "layers": 3,
                    "width": 32,
                    "heads": 2,
                    "ffn": 64,
                    "input": "patches",
                    "image_size": 32,
                    "patch_size": 8,
                    "channels": 1,
                },
                "objective": {"name": "classification"},
                "data": {"name": "digits"},
                "train": train,
            },
        )
        reverse = _train(
            root,
            "reverse_deepnorm",
            {
                "model": {
                    "arch": "encoder_decoder",
                    "scheme": "deepnorm",
                    "layers": 2,
                    "decoder_layers": 3,
                    "width": 32,
                    "heads": 2,
                    "ffn": 64,
                    "vocab_size": 16,
                    "max_len": 24,
                },
                "objective": {"name": "seq2seq"},
                "data": {"name": "synthetic", "task": "reverse"},
                "train": train,
            },
        )
    finally:
        torch.set_num_threads(before)
    return digits, reverse


def test_patch_model_run_matches_a_direct_computation(runs, tmp_path):
    from kilolayer.data import load_source
    from kilolayer.train.checkpoint import load_run

    run = runs[0]
    out = tmp_path / "a"
    assert (
        main(
            [
                "analyze",
                "smoothness",
                "--run",
                str(run),
                "--samples",
                "20",
                "--batch-size",
                "8",
                "--exclude-cls",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads((out / "smoothness.json").read_text())
    assert result["layers"] == [0, 1, 2, 3] and result["grid"] == 4 and result["samples"] == 20
    assert result["source"] == "run" and result["name"] == "digits_vit"

    # by hand: every layer's hidden states of the newest checkpoint on the same 20 evaluation images
    config, task = load_run(run)
    hidden, images = [[] for _ in range(4)], []
    with torch.no_grad():
        for batch in load_source(config).eval_batches(8, limit=20):
            kwargs, _ = task.objective.analysis_inputs(batch)
            images.append(kwargs["inputs"])
            task.backbone(**kwargs, observe=lambda i, h: hidden[i].append(h.clone()))
    states = [torch.cat(h) for h in hidden]
    assert states[0].shape[:2] == (20, 17)  # CLS + 4x4 patches
    # the patches whose pixels are all equal (digits' blank border) are left out, per image, by default
    k = config.model.patch_size
    patches = torch.cat(images).unfold(2, k, k).unfold(3, k, k).reshape(20, 16, -1)
    content = [(p.amax(-1) != p.amin(-1)).nonzero().flatten() + 1 for p in patches]
    assert 0 < sum(len(c) for c in content) < 20 * 16
    by_hand = [statistics.fmean(token_cosine(h[j : j + 1, c]).item() for j, c in enumerate(content)) for h in states]
    assert result["cosine"] == pytest.approx(by_hand, abs=1e-6)
    assert result["exclude_blank"] and result["blank_share"] == pytest.approx(1 - sum(map(len, content)) / 320)
    assert result["high_freq"] == pytest.approx([high_frequency(h, 4).mean().item() for h in states], abs=1e-5)


def test_encoder_decoder_run_analyses_the_encoder(runs, tmp_path):
    out = tmp_path / "b"
    assert main(["analyze", "smoothness", "--run", str(runs[1]), "--samples", "16", "--out", str(out)]) == 0
    result = json.loads((out / "smoothness.json").read_text())
    assert result["layers"] == [0, 1, 2] and result["depth"] == 2 and "high_freq" not in result


def test_run_errors(runs, tmp_path, capsys):
    def error(args):
        assert main(args) != 0
        err = capsys.readouterr().err.strip()
        assert err.startswith("kilolayer: error: ") and "\n" not in err, err
        return err

    assert "not a kilolayer run directory" in error(
        ["analyze", "smoothness", "--run", str(tmp_path), "--out", str(tmp_path / "o")]
    )
    text = tmp_path / "t.txt"
    text.write_text("hello\n")
    assert "--data NAME" in error(
        ["analyze", "smoothness", "--run", str(runs[1]), "--text", str(text), "--out", str(tmp_path / "o")]
    )
