"""User errors are one line naming the field (or input), the bad value and what is allowed; never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal

import pytest
import torch
from helpers import ROOT
from pydantic import Field

from kilolayer import ConfigError, InputError, build_model, load_config
from kilolayer.cli import main

KILOLAYER = Path(sys.executable).parent / "kilolayer"

# (--set items, source, fragments the one-line message must contain)
BAD = {
    "unknown scheme": (
        ["model.scheme=deepnet"],
        "bert_base",
        ["model.scheme", "'deepnet'", "allowed", "deepnorm", "post_ln", "pre_ln"],
    ),
    "width not divisible by heads": (
        ["model.width=100", "model.heads=3"],
        None,
        ["model.width=100", "model.heads=3", "divisible"],
    ),
    "negative depth": (["model.layers=-2"], "gpt2_small", ["model.layers=-2", "greater than or equal to 1"]),
    "negative decoder depth": (
        ["model.decoder_layers=-1"],
        "transformer_base",
        ["model.decoder_layers=-1", "greater than or equal to 0"],
    ),
    "zero decoder layers": (
        ["model.arch=encoder_decoder", "model.decoder_layers=0"],
        None,
        ["model.decoder_layers=0", "at least 1"],
    ),
    "unknown preset": (
        [],
        "vit_b61",
        ["vit_b61", "neither a preset nor a config file", "vit_b16", "kilolayer presets"],
    ),
    "unknown preset, no near name": ([], "nope", ["nope", "neither a preset nor a config file", "kilolayer presets"]),
    "unknown key": (["model.wdith=64"], None, ["model.wdith", "unknown key", "allowed", "width", "heads"]),
    "unknown section": (["modle.width=64"], None, ["modle", "unknown key", "model", "objective", "train"]),
    "wrong type (int)": (["model.width=wide"], None, ["model.width='wide'", "integer"]),
    "wrong type (bool)": (["model.bias=maybe"], None, ["model.bias='maybe'", "boolean"]),
    "wrong type (list)": (["model.dropout=[0.1]"], None, ["model.dropout=[0.1]", "number"]),
    "bad choice": (["model.arch=rnn"], None, ["model.arch='rnn'", "encoder", "decoder", "encoder_decoder"]),
    "patches on a decoder": (["model.input=patches", "model.arch=decoder"], None, ["model.input", "encoder"]),
    "set without =": (["model.width"], None, ["model.width", "key.path=value"]),
    # pydantic alone would read true as 1: a one-step run, a peak of 1 FLOP/s
    "true for a count": (["train.steps=true"], None, ["train.steps=True", "expected a number, not true"]),
    "true for a peak": (["train.peak_flops=true"], None, ["train.peak_flops=True", "expected a number, not true"]),
    "false for a rate": (["model.dropout=false"], None, ["model.dropout=False", "expected a number, not false"]),
}


def one_line(msg: str) -> str:
    assert msg and "\n" not in msg.strip(), f"not one line: {msg!r}"
    assert "Traceback" not in msg and "pydantic" not in msg.lower() and "errors.pydantic.dev" not in msg
    return msg


@pytest.mark.parametrize("case", list(BAD))
def test_load_config_errors(case):
    sets, source, fragments = BAD[case]
    with pytest.raises(ConfigError) as info:
        load_config(source, sets=sets)
    msg = one_line(str(info.value))
    for f in fragments:
        assert f in msg, f"{case}: {f!r} missing from {msg!r}"


@pytest.mark.parametrize("case", list(BAD))
def test_cli_errors(case, capsys):
    sets, source, fragments = BAD[case]
    argv = ["describe", source or "bert_base"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    line = one_line(err.strip())
    assert line.startswith("kilolayer: error: ")
    for f in fragments:
        assert f in line


@pytest.mark.integration
@pytest.mark.parametrize(
    "args, fragments",
    [
        (["describe", "nope"], ["nope: neither a preset nor a config file", "kilolayer presets"]),
        (["configs", "--like", "vit_b16", "--set", "model.heads=5"], ["model.width=768", "model.heads=5"]),
    ],
)
def test_installed_command(args, fragments):
    """The real entry point: exit 2, exactly one line on stderr, nothing on stdout, no traceback."""
    proc = subprocess.run([str(KILOLAYER), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0]


def test_missing_yaml_path_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {width: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(bad))
    assert "bad.yaml: not valid YAML" in one_line(str(info.value))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(str(listy))


def test_yaml_file_errors_name_the_field(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("model:\n  width: 96\n  heads: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(p))
    assert one_line(str(info.value)) == "model.width=96: must be divisible by model.heads=5"


def test_build_model_with_a_bad_dict():
    with pytest.raises(ConfigError) as info:
        build_model({"scheme": "deepnorm", "layers": 0})
    assert "model.layers=0" in one_line(str(info.value))
    with pytest.raises(ConfigError) as info:
        build_model({"width": 64, "hedas": 2})
    assert "model.hedas: unknown key; did you mean model.heads? allowed:" in one_line(str(info.value))


def test_good_config_loads():
    cfg = load_config("transformer_base", sets=["model.scheme=deepnorm", "model.layers=18", "train.steps=3"])
    assert (cfg.model.scheme, cfg.model.layers, cfg.model.decoder_layers, cfg.train.steps) == ("deepnorm", 18, 6, 3)


# ---------------------------------------------------------------- model inputs


def _models():
    torch.manual_seed(0)
    small = dict(layers=1, width=16, heads=2, ffn=32, vocab_size=20, max_len=8)
    return {
        "encoder": build_model(dict(arch="encoder", **small)),
        "decoder": build_model(dict(arch="decoder", **small)),
        "encoder_decoder": build_model(dict(arch="encoder_decoder", decoder_layers=1, **small)),
        "patches": build_model(
            dict(
                arch="encoder",
                input="patches",
                image_size=8,
                patch_size=4,
                channels=3,
                layers=1,
                width=16,
                heads=2,
                ffn=32,
            )
        ),
    }


MODELS = _models()
ids = torch.zeros(2, 5, dtype=torch.long)

BAD_INPUTS = {
    "float token ids": ("encoder", (torch.zeros(2, 5),), ["tokens", "integer", "float32"]),
    "1-D token ids": ("decoder", (torch.zeros(5, dtype=torch.long),), ["tokens", "(batch, length)", "(5,)"]),
    "3-D token ids": ("encoder", (torch.zeros(2, 5, 1, dtype=torch.long),), ["tokens", "(2, 5, 1)"]),
    "a list": ("encoder", ([[1, 2, 3]],), ["tokens", "torch.Tensor", "list"]),
    "ids out of range": ("encoder", (torch.full((2, 5), 20),), ["tokens", "[0, 20)", "20"]),
    "negative ids": ("decoder", (torch.full((2, 5), -1),), ["tokens", "[0, 20)", "-1"]),
    "too long": ("decoder", (torch.zeros(2, 9, dtype=torch.long),), ["tokens", "9", "model.max_len=8"]),
    "float target ids": ("encoder_decoder", (ids, torch.zeros(2, 5)), ["tgt:", "integer"]),
    "float source ids": ("encoder_decoder", (torch.zeros(2, 5), ids), ["src:", "integer"]),
    "target too long": ("encoder_decoder", (ids, torch.zeros(2, 9, dtype=torch.long)), ["tgt:", "max_len=8"]),
    "image of the wrong size": (
        "patches",
        (torch.zeros(2, 3, 16, 16),),
        ["images", "(batch, 3, 8, 8)", "(2, 3, 16, 16)"],
    ),
    "image without batch": ("patches", (torch.zeros(3, 8, 8),), ["images", "(batch, 3, 8, 8)", "(3, 8, 8)"]),
    "integer image": ("patches", (torch.zeros(2, 3, 8, 8, dtype=torch.uint8),), ["images", "floating", "uint8"]),
    "float padding mask": ("encoder", (ids, torch.zeros(2, 5)), ["padding_mask", "bool", "(2, 5)"]),
    "padding mask of the wrong shape": (
        "decoder",
        (ids, torch.zeros(2, 4, dtype=torch.bool)),
        ["padding_mask", "(2, 5)", "(2, 4)"],
    ),
    "source padding mask of the wrong shape": (
        "encoder_decoder",
        (ids, ids, torch.zeros(2, 6, dtype=torch.bool)),
        ["src_padding_mask", "(2, 5)"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_one_line_input_errors(case):
    arch, args, fragments = BAD_INPUTS[case]
    with pytest.raises(InputError) as info:
        MODELS[arch](*args)
    msg = one_line(str(info.value))
    for f in fragments:
        assert f in msg, f"{case}: {f!r} missing from {msg!r}"


def test_good_inputs_pass():
    assert MODELS["encoder"](ids).shape == (2, 5, 16)
    assert MODELS["encoder_decoder"](ids, ids[:, :3]).shape == (2, 3, 16)
    assert MODELS["patches"](torch.zeros(2, 3, 8, 8)).shape == (2, 5, 16)


@pytest.mark.parametrize(
    "sets, fragments",
    [
        (["data.options.max_per_class=true"], ["data.options.max_per_class=True", "expected a number, not true"]),
        (["objective.options.num_classes=true"], ["objective.options.num_classes=True", "not true"]),
    ],
)
def test_options_refuse_a_bool_for_a_number(sets, fragments):
    from kilolayer.data import load_source
    from kilolayer.objectives import build_task

    cfg = load_config("configs/stdlib_classify.yaml", sets=sets)
    with pytest.raises(ConfigError) as info:
        build_task(cfg, load_source(cfg))
    msg = one_line(str(info.value))
    assert all(f in msg for f in fragments), msg


def test_bools_stay_bools_and_numbers_numbers():
    cfg = load_config(None, sets=["train.fused_optimizer=true", "train.compile=true", "train.peak_flops=2e11"])
    assert cfg.train.fused_optimizer is True and cfg.train.compile == "layers" and cfg.train.peak_flops == 2e11
    assert load_config(None, sets=["train.steps=7"]).train.steps == 7


@pytest.mark.parametrize(
    "value, annotation, refused",
    [
        (True, int, True),
        (True, bool, False),
        (True, bool | int, False),  # a bool is one of the choices
        (False, Literal[False, "layers"], False),
        (True, Literal[0, 1], True),
        ((False, 0.5), tuple[float, float], True),
        ((0.9, 0.5), tuple[float, float], False),
        ([True], list[int], True),
        ([True], list[bool], False),
        ((1, True), tuple[int, ...], True),
        ({"a": True}, dict[str, float], True),
        ({"k": [True]}, dict[str, list[int]], True),
        (True, Annotated[int, Field(ge=0)] | None, True),
        (True, float | str, True),
        ("x", float | str, False),
        (None, float | None, False),
        (True, Literal["a"], False),
    ],
)
def test_a_bool_is_refused_wherever_a_number_is_wanted(value, annotation, refused):
    from kilolayer.config import _bool_for_number

    assert _bool_for_number(value, annotation) is refused


def test_a_bool_inside_a_list_of_numbers_is_one_line():
    with pytest.raises(ConfigError) as info:
        load_config(None, sets=["train.betas=[false,0.9]"])
    assert one_line(str(info.value)) == "train.betas=[False, 0.9]: expected a number, not true/false"


@pytest.mark.parametrize(
    "value, needle",
    [
        ("train.betas=[1.5,0.9]", "train.betas.0=1.5"),
        ("train.weight_decay=inf", "train.weight_decay"),
        ("train.eps=nan", "train.eps"),
    ],
)
def test_optimizer_numbers_are_validated(value, needle, capsys):
    rc = main(["describe", str(ROOT / "configs" / "stdlib_gpt.yaml"), "--set", value])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
