"""What a new user meets first: paths in a config, resuming, output into a closed pipe, the resolved config, and
the one-line errors for bad YAML, an unknown key, a missing data file and an empty step budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kilolayer.cli import main
from kilolayer.config import TrainConfig, dump_yaml, load_config
from kilolayer.data import load_source
from kilolayer.errors import ConfigError, InputError
from kilolayer.train.run import train
from tests.helpers import ROOT

# a one-layer byte-level language model on a text file: a step takes milliseconds
TINY = {
    "model": {"arch": "decoder", "layers": 1, "width": 16, "heads": 2, "ffn": 32, "vocab_size": 262, "max_len": 16},
    "objective": {"name": "causal_lm"},
    "train": {"steps": 2, "batch_size": 2, "log_every": 1, "eval_batches": 1, "lr": 1e-3},
}


def project(root: Path, data_path: str = "corpus.txt", **train_section) -> Path:
    """``root/config.yaml`` training TINY on ``root/corpus.txt``, whose ``data.path`` is written as ``data_path``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    config = {
        **TINY,
        "data": {"name": "text_bytes", "path": data_path, "options": {"seq_len": 8, "eval_windows": 2}},
        "train": {**TINY["train"], **train_section},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root / "config.yaml"


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def test_a_relative_data_path_resumes_from_another_directory(tmp_path, monkeypatch):
    cfg = project(tmp_path / "project")
    run = tmp_path / "runs" / "r"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the config's path is its own folder's, wherever training starts
    assert train(str(cfg), run, quiet=True) == {"status": "completed", "step": 2}
    written = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert written["path"] == str(tmp_path / "project" / "corpus.txt")

    monkeypatch.chdir(tmp_path / "runs")
    assert train(None, run, resume=True, sets=["train.steps=3"], quiet=True) == {"status": "completed", "step": 3}


def test_paths_given_with_set_are_the_working_directorys(tmp_path, monkeypatch):
    cfg = project(tmp_path / "project")
    monkeypatch.chdir(tmp_path)
    config = load_config(str(cfg), ["data.path=other.txt", "train.init_from=runs/pretrained"])
    assert (config.data.path, config.train.init_from) == (
        str(tmp_path / "other.txt"),
        str(tmp_path / "runs/pretrained"),
    )
    parallel = load_config({"data": {"name": "parallel", "options": {"source": "a.de", "target": "~/a.en"}}})
    assert parallel.data.options == {"source": str(tmp_path / "a.de"), "target": str(Path.home() / "a.en")}


def test_the_resolved_config_holds_only_the_data_fields_its_source_reads():
    text = yaml.safe_load(dump_yaml(load_config({"data": {"name": "text_bytes", "path": "/data/corpus.txt"}})))
    assert text["data"] == {"name": "text_bytes", "path": "/data/corpus.txt", "options": {}}
    synthetic = load_config({"model": {"arch": "encoder_decoder", "decoder_layers": 1}, "data": {"name": "synthetic"}})
    assert yaml.safe_load(dump_yaml(synthetic))["data"] == {"name": "synthetic", "task": "reverse", "options": {}}
    assert yaml.safe_load(dump_yaml(load_config({})))["data"] == {"name": "stdlib_bytes", "options": {}}
    for config in (synthetic, load_config({})):  # what is left out loads back as it was
        assert load_config(yaml.safe_load(dump_yaml(config))) == config


def test_malformed_yaml_names_file_line_column_and_reason(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  width: 64\n  heads 4: x: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(bad))
    # the pure-Python parser's words, which say more than libyaml's (the C parser reads the configs that parse)
    assert str(info.value) == f"{bad}: not valid YAML at line 3, column 13: mapping values are not allowed here"
    bad.write_text("model:\n\twidth: 64\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(bad))
    assert str(info.value) == (
        f"{bad}: not valid YAML at line 2, column 1: found character '\\t' that cannot start any token "
        "(while scanning for the next token)"
    )


def test_an_unknown_key_suggests_the_nearest_allowed_one():
    with pytest.raises(ConfigError) as info:
        load_config({}, ["train.step=3"])
    allowed = ", ".join(TrainConfig.model_fields)
    assert str(info.value) == f"train.step: unknown key; did you mean train.steps? allowed: {allowed}"


def test_text_bytes_names_data_path_when_the_file_is_missing(tmp_path):
    missing = tmp_path / "nothing.txt"
    config = load_config({**TINY, "data": {"name": "text_bytes", "path": str(missing)}})
    with pytest.raises(InputError) as info:
        load_source(config)
    assert str(info.value) == f"{missing}: no such file (data.path)"


def configs_rows(capsys, *args) -> tuple[str, list[list[str]]]:
    """``kilolayer configs ARGS``: its title and its table's rows as cells."""
    assert main(["configs", *args]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    return " ".join(out.split("┏")[0].split()), rows


def test_configs_like_a_config_keeps_its_head_size(tmp_path, capsys):
    cfg = tmp_path / "my.yaml"
    cfg.write_text(yaml.safe_dump({"model": {**TINY["model"], "width": 64, "heads": 4, "ffn": 256}}))
    title, rows = configs_rows(capsys, "--like", str(cfg), "--tolerance", "0.3")
    assert "head size 16" in title
    assert rows and all(int(width) == 16 * int(heads) for _, _, width, heads, *_ in rows)
    assert ["1", "-", "64", "4", "256"] in [row[:5] for row in rows]
    _, rows = configs_rows(capsys, "--like", str(cfg), "--tolerance", "0.3", "--head-dim", "32")
    assert ["1", "-", "64", "2", "256"] in [row[:5] for row in rows]


def test_resume_into_a_new_directory_says_it_starts_a_new_run(tmp_path, capsys):
    cfg = project(tmp_path / "project", steps=1)
    run = tmp_path / "new"
    assert main(["train", str(cfg), "--out", str(run), "--resume"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"kilolayer: {run} holds no run to resume: starting a new run" in err
    assert main(["train", str(cfg), "--out", str(run), "--resume", "--set", "train.steps=2"]) == 0
    assert "no run to resume" not in capsys.readouterr().err
    assert status(run)["step"] == 2


def test_train_refuses_zero_steps_unless_the_run_is_an_untrained_baseline(tmp_path, capsys):
    cfg = project(tmp_path / "project")
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--set", "train.steps=0"]) == 2
    assert capsys.readouterr().err == (
        "kilolayer: error: train.steps=0: expected at least 1; for an untrained baseline (the initialised model "
        "saved as a run) set train.untrained=true as well\n"
    )
    assert not run.exists()
    # a study's --set train.steps=N leaves its untrained groups untrained
    assert load_config(str(cfg), ["train.untrained=true", "train.steps=50"]).train.steps == 0
    with pytest.raises(ConfigError) as info:
        load_config({"train": {"untrained": "yes", "steps": 2}})
    assert (
        str(info.value) == "train.untrained=true: an untrained baseline trains no step; expected train.steps: 0, not 2"
    )

    assert main(["train", str(cfg), "--out", str(run), "--set", "train.untrained=true"]) == 0
    assert (status(run)["status"], status(run)["step"]) == ("completed", 0)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000000"]


@pytest.mark.integration
def test_a_closed_stdout_does_not_fail_the_run(tmp_path):
    cfg = project(tmp_path / "project", steps=6)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "kilolayer", "train", str(cfg), "--out", str(run)]
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=ROOT)
        proc.stdout.close()  # the reader is gone before the first progress line (`| head -0`)
        assert proc.wait(timeout=300) == 0
    assert "Broken pipe" not in (tmp_path / "stderr").read_text()
    assert (status(run)["status"], status(run)["step"]) == ("completed", 6)
    steps = [
        r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"
    ]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_study_groups_base_config_resolves_every_path_from_its_own_folder(tmp_path, monkeypatch):
    from kilolayer.study.spec import expand, load_spec

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "base.yaml").write_text(
        yaml.safe_dump(
            {
                **TINY,
                "data": {"name": "parallel", "options": {"source": "../data/a.de", "target": "../data/a.en"}},
                "train": {**TINY["train"], "init_from": "../runs/pretrained"},
            }
        )
    )
    (tmp_path / "study").mkdir()
    spec = tmp_path / "study" / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "paths",
                "groups": [
                    {"name": "from_file", "base": "../configs/base.yaml"},
                    {"name": "inline", "base": {**TINY, "data": {"name": "text_bytes", "path": "corpus.txt"}}},
                ],
            }
        )
    )
    (tmp_path / "elsewhere" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere" / "deeper")
    from_file, inline = expand(load_spec(spec))
    assert from_file.config.data.options == {
        "source": str(tmp_path / "data/a.de"),
        "target": str(tmp_path / "data/a.en"),
    }
    assert from_file.config.train.init_from == str(tmp_path / "runs/pretrained")
    assert inline.config.data.path == str(tmp_path / "study" / "corpus.txt")


def test_a_byte_level_run_loads_generates_and_exports_once_its_data_file_is_gone(tmp_path, capsys):
    import kilolayer

    cfg = project(tmp_path / "project")
    run = tmp_path / "run"
    assert train(str(cfg), run, quiet=True)["status"] == "completed"
    before = kilolayer.load(run).generate_ids([104, 105], max_new_tokens=4)
    (tmp_path / "project" / "corpus.txt").unlink()
    trained = kilolayer.load(run)
    assert trained.step == 2 and trained.encode("hi") == [104, 105]
    assert trained.generate_ids([104, 105], max_new_tokens=4) == before  # the same weights, without the data
    assert main(["generate", str(run), "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    assert kilolayer.load(tmp_path / "export").generate_ids([104, 105], max_new_tokens=4) == before
    capsys.readouterr()
    # a run that keeps no tokenizer.json needs its data for its vocabulary: one line naming the missing file
    (run / "tokenizer.json").unlink()
    assert main(["generate", str(run), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "corpus.txt: no such file" in err and "needs the run's data for its vocabulary" in err and "\n" not in err


def test_a_device_this_machine_lacks_is_one_line_in_every_command(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = project(tmp_path / "project")
    run = tmp_path / "run"
    train(str(cfg), run, quiet=True)
    commands = [
        ["generate", str(run), "--prompt", "hi"],
        ["evaluate", str(run)],
        ["analyze", "smoothness", "--run", str(run), "--out", str(tmp_path / "a")],
        ["doctor", str(cfg), "--forecast"],
        ["doctor", str(run)],
    ]
    for command in commands:
        for device, said in [("cuda", "no CUDA device is available here"), ("tpu", "not a torch device")]:
            if device == "tpu" and command[0] in ("generate", "evaluate"):
                continue  # these two take a choice: argparse refuses anything else
            assert main([*command, "--device", device]) == 2, command
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"kilolayer: error: --device {device}: {said}") and "\n" not in err, err
    with pytest.raises(ConfigError, match=r"^device cuda: no CUDA device"):
        import kilolayer

        kilolayer.load(run, device="cuda")


def test_weights_in_checkpoints_and_exports_have_the_mode_of_the_other_files(tmp_path):
    import os
    import stat

    from kilolayer.train.trained import export

    cfg = project(tmp_path / "project")
    run = tmp_path / "run"
    train(str(cfg), run, quiet=True)
    export(run, tmp_path / "export")
    mask = os.umask(0)
    os.umask(mask)
    plain = 0o666 & ~mask  # a plain open's mode
    for folder in [*sorted((run / "checkpoints").iterdir()), tmp_path / "export"]:
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir() if f.is_file()}
        assert modes["model.safetensors"] == modes["config.yaml" if "config.yaml" in modes else "state.json"], modes
        assert set(modes.values()) == {plain}, modes


def test_a_study_set_on_a_grid_key_is_refused_and_nothing_is_written(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    group = {"name": "shapes", "base": {**TINY, "data": {"name": "text_bytes", "path": "corpus.txt"}}}
    grid = {"model.width": [16, 32], "model.layers, model.heads": [[1, 2], [2, 2]]}
    spec.write_text(yaml.safe_dump({"name": "s", "groups": [{**group, "grid": grid}]}))
    out = tmp_path / "out"
    for key in ("model.width", "model.heads"):
        assert main(["study", str(spec), "--out", str(out), "--set", f"{key}=64"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"kilolayer: error: {key} is a grid key of group shapes; --set applies to every group's base"
    assert not out.exists()


@pytest.mark.parametrize(
    "text, said",
    [("", "the file is empty"), ("\n  \n", "the file is empty"), ("# model: {}\n", "the file holds only comments")],
)
def test_an_empty_config_file_says_so(tmp_path, capsys, text, said):
    (tmp_path / "empty.yaml").write_text(text)
    assert main(["train", str(tmp_path / "empty.yaml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kilolayer: error: {tmp_path / 'empty.yaml'}: {said}") and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_a_folder_given_as_the_config_is_named_a_folder(tmp_path, capsys):
    (tmp_path / "configs").mkdir()
    assert main(["train", str(tmp_path / "configs"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kilolayer: error: {tmp_path / 'configs'}: a folder, not a config file")
