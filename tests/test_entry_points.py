"""Plug-ins from other packages: each registry reads its entry-point group once, the first time it lacks a name or
lists its names; an entry point's object is registered under the entry point's name, and one that fails to load is
one line naming the entry point, its package and the error. The example package of examples/plugin installs and
trains with its scheme and its data source by name."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import ROOT

from kilolayer import build_model
from kilolayer.cli import main
from kilolayer.config import load_config
from kilolayer.errors import ConfigError, PluginError
from kilolayer.registry import OBJECTIVES, SCHEMES, SOURCES
from kilolayer.study.findings import FINDINGS
from kilolayer.verdicts.contrasts import CONTRASTS
from kilolayer.verdicts.measures import MEASURES

MODULE = "kl_test_plugins"
PLUGINS = """
from kilolayer.nn.schemes import PreLN


class HalfGainPreLN(PreLN):
    name = "half_gain_pre_ln"

    def init_gain(self, site, weight):
        return 0.5 if weight == "w2" else 1.0


class Misnamed(PreLN):
    name = "something_else"


class PreLNAgain(PreLN):
    pass
"""


@dataclass(frozen=True)
class EntryPoint:
    """One entry point as importlib.metadata gives it for an installed package (``dist``)."""

    name: str
    value: str
    group: str = "kilolayer.schemes"
    dist: object = field(default_factory=lambda: SimpleNamespace(name="my-plugins", version="1.0"))

    def load(self):
        return metadata.EntryPoint(self.name, self.value, self.group).load()


@pytest.fixture
def install(monkeypatch, tmp_path):
    """``install(*entry_points)``: importlib.metadata gives these entry points (the module MODULE defines the
    objects) and SCHEMES reads its group afresh; returns the list of groups looked up."""
    (tmp_path / f"{MODULE}.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(SCHEMES, "_items", dict(SCHEMES._items))
    monkeypatch.setattr(SCHEMES, "_loaded", False)
    monkeypatch.setattr(SCHEMES, "_broken", [])
    looked_up: list[str] = []

    def setup(*eps: EntryPoint) -> list[str]:
        def entry_points(*, group: str) -> list[EntryPoint]:
            looked_up.append(group)
            return [ep for ep in eps if ep.group == group]

        monkeypatch.setattr(metadata, "entry_points", entry_points)
        return looked_up

    yield setup
    sys.modules.pop(MODULE, None)


def test_each_registry_reads_the_group_named_after_it():
    groups = {reg.field: reg.group for reg in (SCHEMES, OBJECTIVES, SOURCES, MEASURES, CONTRASTS, FINDINGS)}
    assert groups == {
        "model.scheme": "kilolayer.schemes",
        "objective.name": "kilolayer.objectives",
        "data.name": "kilolayer.sources",
        "kilolayer.measures": "kilolayer.measures",
        "kilolayer.contrasts": "kilolayer.contrasts",
        "study.findings": "kilolayer.findings",
    }


def test_an_entry_points_object_is_registered_under_its_name_and_builds_the_model(install):
    install(EntryPoint("half_gain_pre_ln", f"{MODULE}:HalfGainPreLN"))
    assert load_config(None, ["model.scheme=half_gain_pre_ln"]).model.scheme == "half_gain_pre_ln"
    assert SCHEMES["half_gain_pre_ln"].__module__ == MODULE
    torch.manual_seed(0)
    model = build_model(
        {"arch": "decoder", "scheme": "half_gain_pre_ln", "layers": 2, "width": 64, "heads": 4, "ffn": 256}
    )
    fc1 = model.decoder.layers[0].ffn.branch.fc1.weight.detach()
    fc2 = model.decoder.layers[0].ffn.branch.fc2.weight.detach()
    xavier = math.sqrt(2 / (256 + 64))
    assert float(fc2.std()) == pytest.approx(0.5 * xavier, rel=0.03)  # the plug-in's gain
    assert float(fc1.std()) == pytest.approx(xavier, rel=0.03)


def test_a_name_held_reads_no_entry_points_and_the_group_is_read_once(install):
    looked_up = install(EntryPoint("half_gain_pre_ln", f"{MODULE}:HalfGainPreLN"))
    assert "deepnorm" in SCHEMES and MODULE not in sys.modules and looked_up == []
    with pytest.raises(ConfigError) as err:
        SCHEMES.get("nope")
    assert "half_gain_pre_ln" in str(err.value).split("allowed: ")[1].split(", ")
    assert "half_gain_pre_ln" in SCHEMES.names() and len(SCHEMES) > 1
    assert looked_up == ["kilolayer.schemes"]


@pytest.mark.parametrize(
    "name, value, error",
    [
        ("broken", "kl_no_such_module:Thing", "ModuleNotFoundError: No module named 'kl_no_such_module'"),
        ("whole", MODULE, "TypeError: it names a module; name the object to register (module:object)"),
        (
            "other_name",
            f"{MODULE}:Misnamed",
            "ValueError: the object's name is 'something_else'; the entry point must have the same name",
        ),
        (
            "pre_ln",
            f"{MODULE}:PreLNAgain",
            "ValueError: model.scheme: 'pre_ln' is already registered to kilolayer.nn.schemes.PreLN",
        ),
    ],
)
def test_an_entry_point_that_does_not_load_is_one_line_naming_it_and_its_package(install, name, value, error):
    install(EntryPoint(name, value), EntryPoint("half_gain_pre_ln", f"{MODULE}:HalfGainPreLN"))
    line = f"kilolayer.schemes entry point {name} = {value} (my-plugins 1.0): {error}"
    with pytest.raises(ConfigError) as err:  # the name not found first, the broken plug-in as its note
        SCHEMES.get("nope")
    assert str(err.value).startswith("model.scheme='nope': unknown residual scheme; allowed: ")
    assert str(err.value).endswith(f" (note: a plug-in did not load: {line})")
    with pytest.raises(PluginError) as err:  # named again on the next listing, not left out in silence
        SCHEMES.names()
    assert str(err.value) == line
    assert SCHEMES._items["half_gain_pre_ln"].__name__ == "HalfGainPreLN"  # the others of the group still load


def test_a_typo_is_reported_as_the_typo_with_a_broken_plugin_as_its_note(install, tmp_path, capsys):
    install(EntryPoint("broken", "kl_no_such_module:Thing"))
    out = tmp_path / "run"
    cfg = str(ROOT / "configs/reverse_deepnorm.yaml")
    code = main(["train", cfg, "--out", str(out), "--set", "model.scheme=deepnrom"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists() and len(err) == 1
    assert err[0].startswith("kilolayer: error: model.scheme='deepnrom': unknown residual scheme; allowed: ")
    assert err[0].endswith(
        "(note: a plug-in did not load: kilolayer.schemes entry point broken = kl_no_such_module:Thing "
        "(my-plugins 1.0): ModuleNotFoundError: No module named 'kl_no_such_module')"
    )


# what a fresh interpreter sees of the plugin, then `kilolayer ARGS` (the command's own main) in it; the JSON is
# the last line of stdout, the command's exit status the process's
PROBE = """
import json, sys
import kilolayer
from kilolayer.config import load_config
from kilolayer.data import load_source

imported = "kilolayer_example_plugin" in sys.modules
from kilolayer.cli import main
config = load_config("examples/plugin/config.yaml")
tokens = load_source(config).train_batch(0, 4)["tokens"]
w2 = kilolayer.build_model(config.model).decoder.layers[0].ffn.branch.fc2.weight.detach()
code = main(sys.argv[1:])
print(json.dumps({"imported_by_import_kilolayer": imported, "tokens": tokens.tolist(), "w2_std": float(w2.std())}))
sys.exit(code)
"""


@pytest.mark.integration
@pytest.mark.slow
def test_the_example_plugin_installs_and_trains_with_its_scheme_and_source_by_name(tmp_path):
    # pip builds in the folder it is given: a copy keeps the repository's clean
    src = shutil.copytree(ROOT / "examples" / "plugin", tmp_path / "plugin")
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    installed = subprocess.run([*pip, "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    # the shared .venv is not changed: the package and its entry points are found on PYTHONPATH
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}

    out = tmp_path / "run"
    steps = ["train.steps=4", "train.eval_every=4", "train.checkpoint_every=4", "train.log_every=1"]
    train = ["train", "examples/plugin/config.yaml", "--out", str(out), *(a for s in steps for a in ("--set", s))]
    probe = subprocess.run([sys.executable, "-c", PROBE, *train], capture_output=True, text=True, cwd=ROOT, env=env)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["imported_by_import_kilolayer"] is False
    tokens = torch.tensor(seen["tokens"])
    assert tokens.shape == (4, 16) and bool((tokens[:, :8] == tokens[:, 8:]).all()) and int(tokens.max()) < 16
    # GPT-2's 1/sqrt(N) on w2, N = 8 residual sublayers of the 4-layer decoder, times Xavier's std for 64 x 256
    assert seen["w2_std"] == pytest.approx(8**-0.5 * math.sqrt(2 / (256 + 64)), rel=0.03)

    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert (resolved["model"]["scheme"], resolved["data"]["name"]) == ("gpt2_pre_ln", "repeat")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["split"] == "train")
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(16), abs=0.5)  # about chance at the start
