"""Hugging Face loads never run a model directory's own Python code."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kilolayer.analysis.hf import load_hf  # noqa: E402
from kilolayer.errors import InputError  # noqa: E402

AUTO = ("AutoConfig", "AutoModel", "AutoImageProcessor", "AutoTokenizer")


@pytest.fixture
def spy(monkeypatch):
    """Every Auto*.from_pretrained call as (class name, kwargs), still loading for real."""
    calls = []
    for name in AUTO:
        cls = getattr(transformers, name)
        original = cls.from_pretrained

        def recording(*args, _name=name, _original=original, **kwargs):
            calls.append((_name, kwargs))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", recording)
    return calls


def _tiny_bert(root):
    t = transformers
    torch.manual_seed(0)
    root.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "."]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    t.BertTokenizerFast(vocab_file=str(root / "vocab.txt")).save_pretrained(root)
    t.BertModel(
        t.BertConfig(
            vocab_size=len(vocab),
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
        )
    ).save_pretrained(root)


def _tiny_vit(root):
    t = transformers
    torch.manual_seed(0)
    t.ViTModel(
        t.ViTConfig(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            image_size=16,
            patch_size=8,
        )
    ).save_pretrained(root)
    t.ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(root)


def test_every_auto_load_says_trust_remote_code_false(tmp_path, spy):
    _tiny_bert(tmp_path / "bert")
    _tiny_vit(tmp_path / "vit")
    text = load_hf(tmp_path / "bert", "text")
    images = load_hf(tmp_path / "vit", "images")
    assert text.model_type == "bert" and images.model_type == "vit"
    assert sorted({name for name, _ in spy}) == sorted(AUTO)
    for name, kwargs in spy:
        assert kwargs.get("trust_remote_code") is False, name
        assert kwargs.get("local_files_only") is True, name


def test_custom_code_in_a_model_directory_is_refused_not_run(tmp_path, spy):
    marker = tmp_path / "ran"
    d = tmp_path / "custom"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "kilolayer_custom_test",
                "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"},
            }
        )
    )
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('1')\n")
    with pytest.raises(InputError, match=r"--hf .*custom: cannot read config.json"):
        load_hf(d, "text")
    assert not marker.exists()
    assert spy and all(kwargs.get("trust_remote_code") is False for _, kwargs in spy)
