"""Scientific notation without a dot (``1e-3``, ``5E4``) is a float wherever kilolayer reads YAML: config files,
study specs, their claims and ``--set`` values (PyYAML's YAML 1.1 resolver alone would load them as strings)."""

from __future__ import annotations

import pytest
import yaml
from helpers import ROOT

from kilolayer.config import load_config, load_yaml, parse_set
from kilolayer.study.spec import expand, load_spec


@pytest.mark.parametrize(
    "text, value",
    [("1e-3", 0.001), ("5E4", 50000.0), ("-2e+2", -200.0), ("1.0e3", 1000.0), (".5e1", 5.0), ("3e0", 3.0)],
)
def test_scientific_notation_loads_as_a_float(text, value):
    loaded = load_yaml(f"x: {text}")["x"]
    assert type(loaded) is float and loaded == value


@pytest.mark.parametrize("text, value", [("1e3x", "1e3x"), ("1_000", 1000), ("e5", "e5"), ("'1e-3'", "1e-3")])
def test_what_is_not_a_float_stays_what_it_was(text, value):
    loaded = load_yaml(f"x: {text}")["x"]
    assert type(loaded) is type(value) and loaded == value


def test_a_config_file_reads_1e_3_as_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {lr: 1e-3, steps: 5E1, weight_decay: 1e-2}\n")
    cfg = load_config(path)
    assert cfg.train.lr == 0.001 and cfg.train.steps == 50 and cfg.train.weight_decay == 0.01


def test_a_set_value_reads_1e_3_as_a_float():
    assert parse_set("train.lr=1e-3") == (["train", "lr"], 0.001)
    assert load_config(None, ["train.lr=2E-4"]).train.lr == 0.0002


def test_a_study_spec_and_its_claims_read_1e_3_as_a_float(tmp_path):
    """Grid values in scientific notation are numbers: the points are named by them as numbers, a claim's values
    and margin written the same way match the grid, and ``where: max`` (numbers only) accepts them."""
    text = f"""
name: lr
groups:
  - name: sweep
    base: {ROOT / "configs" / "stdlib_gpt.yaml"}
    set: {{train.steps: 60, train.lr: 1e-3}}
    grid:
      train.lr: [1e-3, 3e-3]
      train.warmup: [1e1, 2e1]
claims:
  - name: lower_lr
    claim: the lower learning rate reaches the lower loss
    source: a test
    runs: sweep
    measure: eval_loss
    compare: {{key: train.lr, claimed_better: 1e-3, against: 3e-3}}
    where: {{train.warmup: max}}
    margin: 2e-2
"""
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    spec = load_spec(path, ["train.batch_size=1.6e1"])
    points = expand(spec)
    assert [p.values["train.lr"] for p in points[::2]] == [0.001, 0.003]
    assert points[0].name == "lr=0.001_warmup=10.0_seed=0"
    assert {p.config.train.batch_size for p in points} == {16}
    claim = spec.claims[0]
    assert claim.margin == 0.02 and claim.contrast.claimed_better == 0.001
    # the same spec as YAML 1.1 reads it: the values are strings, so the claim could not name them as numbers
    assert yaml.safe_load(text)["groups"][0]["grid"]["train.lr"] == ["1e-3", "3e-3"]


def test_a_string_that_reads_as_a_number_is_written_quoted_and_loads_back_a_string():
    """What kilolayer writes as YAML (a run's config.yaml, a study point's grid values as --set items) loads back
    as it was: a string such as ``1e3``, which unquoted reads as a float, is written quoted."""
    from kilolayer.config import to_yaml
    from kilolayer.study.spec import _sets

    data = {"tag": "1e3", "lr": 1e-3, "big": 1e20, "name": "deepnorm"}
    assert load_yaml(to_yaml(data)) == data
    assert [parse_set(item) for item in _sets({"data.options.tag": "1e3", "train.lr": 1e-3})] == [
        (["data", "options", "tag"], "1e3"),
        (["train", "lr"], 0.001),
    ]
