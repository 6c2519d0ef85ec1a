"""`kilolayer analyze stability` on hand-written metrics.jsonl files, and the smoothness --compare overlay."""

import json
import math

import pytest

from kilolayer.analysis.stability import (
    Diagnostics,
    mean_log_gradients,
    pick_steps,
    read_metrics,
    read_run,
    read_runs,
    top_stack,
)
from kilolayer.cli import main
from kilolayer.errors import InputError

LAYERS = ["encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1", "decoder.2"]
LN_NAMES = [
    f"{side}.layers.{i}.{sub}.norm" for side in ("encoder", "decoder") for i in range(3) for sub in ("self_attn", "ffn")
]


def _write_run(root, name, grad_scale, update_growth, ln_growth, diverge=False):
    """A run whose bottom-layer gradients shrink by ``grad_scale`` per layer and whose update grows."""
    run = root / name
    run.mkdir()
    lines = []
    for step in range(0, 9, 2):
        lines.append({"step": step, "split": "train", "loss": 5.0 - 0.3 * step, "lr": 1e-3})
        lines.append(
            {
                "step": step,
                "split": "diagnostics",
                "layers": LAYERS,
                "grad_norm": [grad_scale ** (len(LAYERS) - 1 - i) * (1 + 0.01 * step) for i in range(len(LAYERS))],
                "update": update_growth * step,
                "ln_names": LN_NAMES,
                "ln_input": [1.0 + ln_growth * i for i in range(len(LN_NAMES))],
            }
        )
    lines.append({"step": 8, "split": "eval", "loss": 2.7})
    text = "\n".join(json.dumps(x) for x in lines) + "\n"
    if diverge:
        text += '{"step": 9, "split": "train", "loss": NaN}\n{"step": 10, "split": "diagn'  # cut off mid-write
    (run / "metrics.jsonl").write_text(text)
    return run


@pytest.fixture
def runs(tmp_path):
    return (
        _write_run(tmp_path, "post_ln", grad_scale=0.3, update_growth=2.0, ln_growth=1.5, diverge=True),
        _write_run(tmp_path, "deepnorm", grad_scale=0.9, update_growth=0.05, ln_growth=0.1),
    )


def test_read_run(runs):
    post, deep = read_runs(list(runs))
    assert post.name == "post_ln" and deep.name == "deepnorm"
    assert [d.step for d in post.diagnostics] == [0, 2, 4, 6, 8]
    d = post.at(5)  # nearest logged step
    assert d.step in (4, 6) and d.layers == LAYERS and len(d.ln_input) == len(LN_NAMES)
    assert d.grad_norm[0] == pytest.approx(0.3**5 * (1 + 0.01 * d.step))
    assert post.diagnostics[-1].update == pytest.approx(16.0)
    assert post.losses["eval"] == [(8, 2.7)]
    assert math.isnan(post.losses["train"][-1][1])  # the NaN loss is kept, the cut-off last line dropped
    assert pick_steps([post]) == [0, 4, 8]


def test_stability_cli(runs, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["analyze", "stability", "--run", str(runs[0]), "--run", str(runs[1]), "--svg", "--out", str(out)]) == 0
    assert (out / "stability.png").stat().st_size > 20_000 and (out / "stability.svg").is_file()
    summary = json.loads((out / "stability.json").read_text())
    assert summary["post_ln"]["update"] == [0.0, 4.0, 8.0, 12.0, 16.0]
    assert summary["deepnorm"]["steps"] == [0, 2, 4, 6, 8]
    assert summary["post_ln"]["max_ln_input"] == pytest.approx(1.0 + 1.5 * 11)
    printed = capsys.readouterr().out
    assert "post_ln: diagnostics at 5 steps" in printed and "deepnorm" in printed


def test_chosen_steps(runs, tmp_path):
    assert main(["analyze", "stability", "--run", str(runs[0]), "--steps", "2", "6", "--out", str(tmp_path / "p")]) == 0


def _error(args, capsys):
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.startswith("kilolayer: error: ") and "\n" not in err, err
    return err


def test_stability_errors(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    err = _error(["analyze", "stability", "--run", str(run), "--out", str(tmp_path / "o")], capsys)
    assert "no metrics.jsonl" in err
    (run / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 3.0}\n')
    err = _error(["analyze", "stability", "--run", str(run), "--out", str(tmp_path / "o")], capsys)
    assert "no diagnostics lines" in err and "diagnostics_every" in err
    (run / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 3.0}\nnot json\n{"step": 2}\n')
    with pytest.raises(InputError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(run / "metrics.jsonl")
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "split": "diagnostics", "layers": ["a", "b"], "grad_norm": [1.0], "update": 0.1}) + "\n"
    )
    err = _error(["analyze", "stability", "--run", str(run), "--out", str(tmp_path / "o")], capsys)
    assert "'layers' and 'grad_norm'" in err
    err = _error(["analyze", "stability", "--run", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], capsys)
    assert "no such run directory" in err


def test_read_run_accepts_the_jsonl_path(runs):
    assert read_run(runs[1] / "metrics.jsonl").name == "deepnorm"


# ---------------------------------------------------------------- smoothness --compare


def _smoothness_json(path, name, depth, slope):
    path.parent.mkdir(parents=True, exist_ok=True)
    layers = list(range(depth + 1))
    data = {
        "layers": layers,
        "name": name,
        "samples": 8,
        "depth": depth,
        "cosine": [min(1.0, slope * i / depth) for i in layers],
        "effective_rank": [10 - 5 * i / depth for i in layers],
        "high_freq": [-0.1 * i for i in layers],
    }
    path.write_text(json.dumps(data))
    return path


def test_compare_overlays_models_of_different_depth(tmp_path, capsys):
    a = _smoothness_json(tmp_path / "vit" / "smoothness.json", "ViT (supervised)", 12, 0.9)
    b = _smoothness_json(tmp_path / "mae" / "smoothness.json", "MAE", 48, 0.3)
    out = tmp_path / "cmp"
    assert main(["analyze", "smoothness", "--compare", str(a), str(b), "--out", str(out)]) == 0
    assert (out / "smoothness_compare.png").stat().st_size > 20_000
    assert "smoothness_compare.png" in capsys.readouterr().out


def test_compare_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"layers": [0, 1], "cosine": [0.1]}')
    err = _error(["analyze", "smoothness", "--compare", str(bad), "--out", str(tmp_path / "o")], capsys)
    assert "'cosine' must be a list as long as 'layers'" in err
    bad.write_text("{not json")
    err = _error(["analyze", "smoothness", "--compare", str(bad), "--out", str(tmp_path / "o")], capsys)
    assert "not a readable JSON file" in err
    err = _error(["analyze", "smoothness", "--compare", str(tmp_path / "nope.json"), "--out", str(tmp_path)], capsys)
    assert "no such file" in err


def test_top_stack_and_mean_log_gradients():
    assert top_stack(LAYERS) == [3, 4, 5] and top_stack(LAYERS[:3]) == [0, 1, 2] and top_stack([]) == []
    lines = [Diagnostics(step=s, layers=LAYERS, grad_norm=[g * s for g in (1, 2, 4, 0.5, 1, 8)]) for s in (1, 4, 16)]
    # the geometric mean over steps 1 and 4 of g x step is g x 2; step 16 is left out
    assert mean_log_gradients(lines, [1, 4]) == pytest.approx([math.log(2 * g) for g in (1, 2, 4, 0.5, 1, 8)])
    lines[1].grad_norm[2] = 0.0  # a vanished gradient has no logarithm: that layer only is NaN
    logs = mean_log_gradients(lines, [1, 4])
    assert math.isnan(logs[2]) and logs[3] == pytest.approx(math.log(1.0))
    assert mean_log_gradients(lines, [2, 3]) is None  # no line at those steps
    lines[0].layers = LAYERS[::-1]
    assert mean_log_gradients(lines, [1, 4]) is None  # lines of different models
