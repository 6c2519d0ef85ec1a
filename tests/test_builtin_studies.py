"""The built-in studies are YAML files, ``kilolayer/studies/NAME.yaml``: each is registered under its file name,
loads and expands to valid configs, holds its numbers as numbers, and comes back unshared however its file uses
anchors. No training, no data."""

from __future__ import annotations

import math

import pytest

from kilolayer.study.builtin import BUILTIN, STUDIES
from kilolayer.study.spec import expand, load_spec

FILES = sorted(p.name.removesuffix(".yaml") for p in STUDIES.iterdir() if p.name.endswith(".yaml"))


def _leaves(x, path=""):
    """(path, value) of every scalar in a loaded spec."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def test_every_study_file_is_a_builtin_study_under_its_own_name():
    assert sorted(BUILTIN) == FILES and len(FILES) >= 10
    assert list(BUILTIN)[:2] == ["quick", "deepnet"]  # --list order: quick first
    for name in FILES:
        assert BUILTIN[name]()["name"] == name


@pytest.mark.parametrize("name", FILES)
def test_every_builtin_study_loads_and_expands_to_valid_configs(name):
    spec = load_spec(name)  # validates the spec and its findings' names
    points = expand(spec)  # validates every point's config
    assert points and len({p.key for p in points}) == len(points)
    assert {p.group for p in points} == {g.name for g in spec.groups}


@pytest.mark.parametrize("name", FILES)
def test_numbers_in_a_study_file_are_numbers(name):
    """PyYAML reads ``1e-3`` as a string (it wants ``1.0e-3``); a validated config would turn it back into a float,
    so the slip would stay hidden in the file."""

    def number(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    strings = [(path, v) for path, v in _leaves(BUILTIN[name]()) if isinstance(v, str) and number(v)]
    assert not strings
    for path, v in _leaves(BUILTIN[name]()):
        if path.endswith((".lr", ".min_delta", ".weight_decay", ".mask_ratio")):
            assert isinstance(v, float), (path, v)


@pytest.mark.parametrize("name", ["bamboo", "bamboo_cpu"])
def test_every_plateau_stopped_group_waits_a_quarter_of_its_cap(name):
    """The convergence rule judges a run over its last quarter of steps, so a run that stops on its plateau waits at
    least that long without a gain; a group stopped on accuracy is also scored on the test split."""
    trained = [g for g in BUILTIN[name]()["groups"] if g["base"]["train"]["steps"]]
    assert len(trained) == 8
    for g in trained:
        t = g["base"]["train"]
        assert t["schedule"] == "inverse_sqrt" and t["early_stop_metric"] in ("loss", "accuracy"), g["name"]
        assert t["patience"] >= math.ceil(t["steps"] / (4 * t["eval_every"])), g["name"]
        assert ("test_scores" in g["analyses"]) == (t["early_stop_metric"] == "accuracy"), g["name"]


def test_a_loaded_study_shares_no_part_between_groups():
    """Groups written with anchors (``*shapes``, ``<<: *train``) load as separate objects, so a caller that edits
    one group's settings leaves the others and the next load as they were."""
    spec = BUILTIN["bamboo_cpu"]()
    first, second = spec["groups"][1], spec["groups"][2]
    first["grid"]["model.layers,model.width,model.heads,model.ffn"].append([4, 64, 4, 256])
    first["base"]["model"]["layers"] = 99
    first["base"]["train"]["betas"][0] = 0.5
    assert len(second["grid"]["model.layers,model.width,model.heads,model.ffn"]) == 2
    assert second["base"]["model"]["layers"] == 2 and second["base"]["train"]["betas"] == [0.9, 0.95]
    assert BUILTIN["bamboo_cpu"]()["groups"][1]["base"]["model"]["layers"] == 2


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_a_measured_study_time_says_the_precision_it_was_measured_at(name):
    """``study --list``'s measured minutes come from a run at the study's default precision (auto), and say what
    auto trained at there: fp32 (a CPU without bf16 instructions) or bf16 where it paid."""
    spec = load_spec(name)
    if spec.expected_basis.startswith("measured"):
        assert spec.expected_minutes and ("at fp32" in spec.expected_basis or "at auto" in spec.expected_basis), name
