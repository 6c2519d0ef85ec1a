"""The registries in use: objectives, data sources, findings and built-in studies are each a Registry, config
validation reads them (so a plugin is one file), and every unknown name gets the registry's one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from kilolayer.cli import main
from kilolayer.config import ModelConfig, load_config
from kilolayer.data import SOURCES, load_source
from kilolayer.errors import ConfigError
from kilolayer.objectives import OBJECTIVES
from kilolayer.presets import PRESETS
from kilolayer.registry import Registry
from kilolayer.study.builtin import BUILTIN, builtin_claim_sets, builtin_claims
from kilolayer.study.findings import FINDINGS
from kilolayer.study.spec import load_spec

OBJECTIVE_NAMES = {
    "classification",
    "contrastive",
    "mae",
    "mlm",
    "causal_lm",
    "seq2seq",
}  # docs/data.md, "Objectives"
SOURCE_NAMES = {"digits", "digit_captions", "stdlib_bytes", "synthetic", "mnist", "fashion_mnist", "idx", "ptb"}


def test_each_kind_of_plugin_is_a_registry_with_its_field():
    fields = {reg.field: reg for reg in (OBJECTIVES, SOURCES, FINDINGS, BUILTIN)}
    assert all(isinstance(reg, Registry) for reg in fields.values())
    assert set(fields) == {"objective.name", "data.name", "study.findings", "study"}
    assert set(OBJECTIVES) == OBJECTIVE_NAMES  # every module in kilolayer/objectives/__init__.py registered
    assert SOURCE_NAMES <= set(SOURCES)
    assert set(FINDINGS) == set()  # every built-in claim is data; a finding in Python is a user's plug-in
    assert {"deepnet_postln", "deepnet_update"} <= set(builtin_claims())  # DeepNet's claims, written as data
    assert {"bamboo_smoothing", "deepnet_robust"} <= set(builtin_claim_sets())  # one verdict per pair or axis
    assert list(BUILTIN)[:2] == ["quick", "deepnet"]  # `kilolayer study --list` keeps the order they are added in
    assert all(OBJECTIVES[name].name == name for name in OBJECTIVES)


@pytest.mark.parametrize(
    "sets, message",
    [
        (["objective.name=clasification"], OBJECTIVES.unknown("clasification")),
        (["data.name=minst"], SOURCES.unknown("minst")),
    ],
)
def test_config_validation_reads_the_registry(sets, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert str(err.value) == message
    field, value = sets[0].split("=")
    assert message.startswith(f"{field}={value!r}: unknown ") and "; allowed: " in message


def test_a_plugin_registered_in_a_test_passes_validation_without_touching_config():
    # what a new objective or source module does at import; config.py knows no names
    class Toy:
        name = "toy"

    def toy_source(config):
        return config.data.options["n"]

    with OBJECTIVES.added("toy", Toy), SOURCES.added("toy_data", toy_source):
        cfg = load_config({"objective": {"name": "toy"}, "data": {"name": "toy_data", "options": {"n": 3}}})
        assert cfg.objective.name == "toy" and load_source(cfg) == 3
    with pytest.raises(ConfigError, match="objective.name='toy': unknown objective"):
        load_config({"objective": {"name": "toy"}})


def test_a_build_time_lookup_gives_the_same_line():
    # a config changed without validation (model_copy) still fails in one line when its source is built
    cfg = load_config(None)
    bad = cfg.model_copy(update={"data": cfg.data.model_copy(update={"name": "nope"})})
    with pytest.raises(ConfigError) as err:
        load_source(bad)
    assert str(err.value) == SOURCES.unknown("nope")


def test_study_names_use_the_registry_wording(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_spec("quik")
    assert str(err.value).startswith(BUILTIN.unknown("quik") + "; nor is it a spec file")
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\ngroups: [{name: g}]\nfindings: [nope]\n")
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    assert str(err.value) == FINDINGS.unknown("nope")


def test_presets_are_plain_data_that_validate():
    for name, fields in PRESETS.items():
        assert isinstance(fields, dict) and all(isinstance(v, (str, int, float, bool)) for v in fields.values())
        assert load_config(name).model == ModelConfig(**fields), name
    load_config("bert_base").model.layers = 3  # a loaded preset is a copy
    assert PRESETS["bert_base"]["layers"] == 12


def test_train_with_a_bad_name_exits_with_one_line_and_no_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "gpt2_small", "--set", "data.name=nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kilolayer: error: {SOURCES.unknown('nope')}"
    assert not out.exists()


def test_a_second_field_naming_a_scheme_uses_the_scheme_registry_wording():
    from kilolayer.nn.residual import SCHEMES
    from kilolayer.objectives import build_task

    sets = ["objective.options.decoder_scheme=nope", "model.layers=1", "model.width=32", "model.heads=2"]
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "mnist_mae.yaml", sets)
    with pytest.raises(ConfigError) as err:
        build_task(cfg, None)  # no source: built for its shapes alone
    assert str(err.value) == SCHEMES.unknown("nope", field="objective.options.decoder_scheme")


def test_an_objective_without_options_refuses_a_stray_one(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "gpt2_small", "--set", "objective.options.mask_fraction=0.2", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "kilolayer: error: objective.options.mask_fraction: unknown key"
    assert not out.exists()
