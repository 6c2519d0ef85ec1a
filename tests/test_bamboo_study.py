"""The built-in Bamboo studies (``bamboo`` for one GPU, ``bamboo_cpu`` its slice for 2 cores): every config is
valid, every built-in Bamboo claim finds the groups it reads with the shapes and seeds it pairs, and the depths are
a fair comparison. No training."""

from __future__ import annotations

import pytest

from kilolayer.data.vocab import BYTE_VOCAB
from kilolayer.nn.budget import count_parameters
from kilolayer.study.builtin import BUILTIN, builtin_claim_sets, builtin_claims
from kilolayer.study.spec import expand, load_spec
from kilolayer.verdicts.claims import parse_claim

STUDIES = ("bamboo", "bamboo_cpu")
SETS = ("bamboo_smoothing", "bamboo_depth", "bamboo_depth_tokens")
CLAIMS = {
    name: parse_claim(builtin_claims()[name], name) for s in SETS for name in builtin_claim_sets()[s]
}  # every built-in Bamboo claim
TRAINED = sorted({g for c in CLAIMS.values() for g in c.groups()})  # the groups the claims compare
BASELINES = sorted({c.relative_to for c in CLAIMS.values() if c.relative_to})  # subtracted, never compared


@pytest.fixture(scope="module", params=STUDIES)
def study(request):
    spec = load_spec(request.param)  # validates the spec
    return spec, expand(spec)  # validates every point's config


def _shape(p) -> tuple[int, int, int]:
    m = p.config.model
    return m.layers, m.width, m.heads


def test_registered_and_sized():
    assert all(name in BUILTIN for name in STUDIES)
    cpu = load_spec("bamboo_cpu")
    # the time --list gives is what a run here measured, not a target
    assert cpu.expected_minutes is not None and "measured with --jobs 2" in cpu.expected_basis
    assert "estimated" in load_spec("bamboo").expected_basis


def test_the_claims_read_trained_groups_and_untrained_baselines():
    assert TRAINED == [
        "contrastive",
        "finetune",
        "mae",
        "mlm",
        "mlm_finetune",
        "next_token",
        "supervised",
        "text_classify",
    ]
    assert BASELINES == ["text_untrained", "untrained"] and not set(TRAINED) & set(BASELINES)


def test_every_claim_finds_its_groups_with_the_shapes_it_needs(study):
    spec, points = study
    names = [g.name for g in spec.groups]
    # both studies name every claim of the three sets: each has every group they read
    assert [c.name for c in spec.claims] == list(CLAIMS)
    shapes_of = {g: {_shape(p) for p in points if p.group == g} for g in names}
    seeds_of = {g: {p.values["train.seed"] for p in points if p.group == g} for g in names}
    for group in TRAINED:
        assert group in names, (spec.name, group)
        mine = [p for p in points if p.group == group]
        # the GPU study spans four depths; the CPU slice a shallow-wide and a deep-narrow one: a slope per doubling
        assert len(shapes_of[group]) >= (4 if spec.name == "bamboo" else 2), (spec.name, group, shapes_of[group])
        assert len(seeds_of[group]) >= 2, (spec.name, group)  # the seed is the unit of replication
        # every shape is trained with every seed: the claims pair runs by shape and seed
        assert len(mine) == len(shapes_of[group]) * len(seeds_of[group]), (spec.name, group)
        assert all(p.config.train.steps > 0 for p in mine)
    for claim in CLAIMS.values():
        groups = claim.groups()
        # several groups are compared shape by shape and seed by seed: the same shapes and seeds in each
        assert len({frozenset(shapes_of[g]) for g in groups}) == 1, (spec.name, claim.name)
        assert len({frozenset(seeds_of[g]) for g in groups}) == 1, (spec.name, claim.name)
        if claim.relative_to:  # the baseline at every shape the claim reads (any seed stands in for a missing one)
            base = claim.relative_to
            assert base in names and shapes_of[groups[0]] <= shapes_of[base], (spec.name, claim.name)
            assert all(p.config.train.steps == 0 for p in points if p.group == base), (spec.name, base)
            # the same inputs: an untrained model of the claim's modality
            mine = next(p for p in points if p.group == groups[0]).config
            theirs = next(p for p in points if p.group == base).config
            assert mine.model.input == theirs.model.input, (spec.name, claim.name)
    # one set of shapes for the whole study, so each pair compares the same depths
    assert len({frozenset(shapes_of[g]) for g in names}) == 1


def test_shapes_are_parameter_matched_with_one_head_size(study):
    spec, points = study
    for group in {p.group for p in points}:
        mine = {_shape(p): p.config.model for p in points if p.group == group}
        counts = [count_parameters(m) for m in mine.values()]
        # the blocks' parameters match (layers x width^2); the rest is mostly the byte embedding, 262 x width
        assert max(counts) / min(counts) < 1.06, (spec.name, group, counts)
        assert all(m.width % m.heads == 0 for m in mine.values())
        assert len({m.width // m.heads for m in mine.values()}) == 1, (spec.name, group, mine.keys())
        assert len({m.layers for m in mine.values()}) == len(mine)  # depth is what varies


def test_finetuning_starts_from_the_same_shape_and_seed(study):
    spec, points = study
    by_key = {p.key: p for p in points}
    for tuned, pre in (("finetune", "mae"), ("mlm_finetune", "mlm")):
        for p in (p for p in points if p.group == tuned):
            src = by_key[p.init_from_point]
            assert src.group == pre and _shape(src) == _shape(p)
            assert src.values["train.seed"] == p.values["train.seed"]
            # the pre-trained encoder fits the fine-tuning model: same vocabulary and positions
            assert src.config.model.vocab_size == p.config.model.vocab_size
            assert src.config.model.max_len == p.config.model.max_len


def test_text_is_one_labelled_set_of_paragraphs_read_as_bytes(study):
    """Every text group reads the same LibreOffice help paragraphs (classification, MLM, next byte), as bytes that
    fit the model, and is measured on them; images are MNIST at 28x28."""
    spec, points = study
    text = [p for p in points if p.config.model.input == "tokens"]
    options = text[0].config.data.options
    for p in points:
        cfg = p.config
        if cfg.model.input == "tokens":
            assert cfg.data.name == "lo_help" and cfg.data.options == options, p.key
            assert cfg.model.vocab_size >= BYTE_VOCAB and cfg.model.max_len == points[-1].config.model.max_len
            assert p.analysis_data == {"name": "lo_help", "options": options}, p.key
        else:
            assert cfg.data.name in ("mnist", "mnist_captions") and cfg.model.image_size == 28
    if spec.name == "bamboo_cpu":  # Basic against Writer, every training paragraph of the two
        assert options == {"modules": ["sbasic", "swriter"]}
    assert {p.config.objective.name for p in points if p.config.model.input == "tokens"} == {
        "classification",
        "mlm",
        "causal_lm",
    }


def test_every_trained_point_stops_at_its_plateau_within_its_budget(study):
    spec, points = study
    for p in points:
        tc = p.config.train
        if p.group in BASELINES:
            assert tc.steps == 0
            continue
        assert tc.patience >= 2 and tc.eval_every > 0, p.key
        # room for the plateau to show up before the budget ends, and a wait that spans the last quarter of any
        # run within it (the window in which the claims judge convergence)
        assert tc.steps / 4 <= tc.patience * tc.eval_every <= tc.steps // 2, p.key
        assert tc.schedule != "cosine", p.key  # a budget-shaped schedule would make stopping early unfair
        # pre-training on its loss, classifiers on the accuracy their claims compare
        classifier = p.config.objective.name == "classification"
        assert tc.early_stop_metric == ("accuracy" if classifier else "loss"), p.key


def test_the_side_studies_behind_the_recipe_are_valid_specs(tmp_path):
    """benchmarks.bamboo_cpu_probes: the recipe probe is each probed objective on a seed the study does not use,
    its candidates differing only in the probed setting, one of them the study's, every data option one the
    source accepts; MAE's at both of the study's shapes and on the same 2,048 validation images at either batch
    size; the mean-pooled classifier is the supervised group but for its pooling."""
    import yaml

    from benchmarks.bamboo_cpu_probes import RECIPE, by_loss, mean_pool, recipe
    from kilolayer.data.lo_help import LOHelpOptions
    from kilolayer.data.options import parse_options

    study = expand(load_spec("bamboo_cpu"))
    study_seeds = {p.values["train.seed"] for p in study}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe()))
    points = expand(load_spec(path))
    assert sorted({p.group for p in points}) == sorted(RECIPE)
    assert not {p.values["train.seed"] for p in points} & study_seeds
    for group, (steps, key, values, shapes) in RECIPE.items():
        mine = [p for p in points if p.group == group]
        assert {_shape(p) for p in mine} == {tuple(s[:3]) for s in shapes}
        assert len(mine) == len(values) * len(shapes) and all(p.config.train.steps == steps for p in mine)
        assert all(p.config.train.patience == 0 for p in mine)  # whole curves, no early stop
        keys = key.split(",")
        candidates = [[p.values[k] for k in keys] for p in mine]
        ours = next(p for p in study if p.group == group and _shape(p) == (8, 48, 3))
        assert [
            ours.setting(k) if k.startswith("train.") else ours.config.data.options.get(k.split(".")[-1]) for k in keys
        ] in candidates, group
        for p in mine:
            if p.config.data.name == "lo_help":
                parse_options(LOHelpOptions, p.config.data.options, "data.options")
            else:
                assert p.config.train.eval_batches * p.config.train.batch_size == 2048
    path = tmp_path / "mean.yaml"
    path.write_text(yaml.safe_dump(mean_pool()))
    points = expand(load_spec(path))
    cls = {_shape(p): p for p in study if p.group == "supervised" and p.values["train.seed"] == 0}
    for p in points:
        assert p.config.objective.options["pool"] == "mean" and not p.config.model.cls_token
        assert p.config.train == cls[_shape(p)].config.train and p.config.data == cls[_shape(p)].config.data
    # the loss-stopped twins: the study's classifier points, every shape and seed, but for the stopping measure
    path = tmp_path / "by_loss.yaml"
    path.write_text(yaml.safe_dump(by_loss()))
    twins = {(p.group.removesuffix("_by_loss"), p.name): p for p in expand(load_spec(path))}
    ours = {(p.group, p.name): p for p in study if p.group in ("supervised", "text_classify")}
    assert twins.keys() == ours.keys()
    for key, p in twins.items():
        assert p.config.train.early_stop_metric == "loss" and ours[key].config.train.early_stop_metric == "accuracy"
        same = {"early_stop_metric", "min_delta"}
        assert p.config.train.model_dump(exclude=same) == ours[key].config.train.model_dump(exclude=same)
        assert p.config.model == ours[key].config.model and p.config.data == ours[key].config.data
        assert p.analyses == ours[key].analyses and p.analysis_data == ours[key].analysis_data


def test_probe_summary_reads_a_curve(tmp_path):
    """The recipe probe's summary: best loss and step, the best loss's relative change over the last quarter (the
    convergence rule's measure), seconds per 100 steps, from constructed metrics files."""
    import json

    from benchmarks.bamboo_cpu_probes import curve_summary, setting

    rows = [{"step": s, "split": "eval", "loss": loss} for s, loss in ((100, 2.0), (200, 1.5), (300, 1.2), (400, 1.25))]
    rows += [{"step": 200, "split": "train", "train_s": 3.0}, {"step": 400, "split": "train", "train_s": 3.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    s = curve_summary(path)
    assert (s["best_loss"], s["best_step"], s["last_step"]) == (1.2, 300, 400)
    assert s["last_quarter"] == pytest.approx((1.25 - 1.2) / 1.2)  # no new best after step 300 = 0.75 x 400
    assert s["s_per_100_steps"] == pytest.approx(1.5)
    rows[3]["loss"] = 0.9  # a new best in the last quarter
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert curve_summary(path)["last_quarter"] == pytest.approx((0.9 - 1.2) / 1.2)
    values = {"model.layers": 8, "model.width": 48, "model.heads": 3, "model.ffn": 192, "train.batch_size": 256}
    values |= {"train.lr": 0.01, "train.eval_batches": 8, "data.options.modules": ["a", "b"], "train.seed": 7}
    assert setting(values) == "8 x 48, batch_size 256, lr 0.01, modules 2"


def test_probe_summary_of_a_folder_without_a_probe_is_one_line(tmp_path, capsys):
    from benchmarks.bamboo_cpu_probes import main

    assert main(["summary", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"--out {tmp_path}: no spec.yaml there; run the recipe probe into it first"


def test_by_loss_summary_sets_each_twin_beside_its_study_run(tmp_path):
    """The by_loss probe's table, from constructed run folders: per group and shape, the accuracy-chosen and
    loss-chosen checkpoints' steps and last-layer cosines and their differences from the token-level model of the
    same shape and seed; a point whose runs are not all there is left out."""
    import json

    import yaml

    from benchmarks.bamboo_cpu_probes import by_loss, by_loss_summary

    out, study = tmp_path / "probe", tmp_path / "study"
    out.mkdir()
    (out / "spec.yaml").write_text(yaml.safe_dump(by_loss()))
    points = [p for p in expand(load_spec(out / "spec.yaml")) if p.group == "supervised_by_loss"]
    deep = [p for p in points if p.config.model.layers == 8]

    def run(folder, step: int, cosine: float) -> None:
        (folder / "analysis" / "smoothness").mkdir(parents=True)
        (folder / "status.json").write_text(json.dumps({"status": "completed", "step": step + 800, "best_step": step}))
        (folder / "analysis" / "smoothness" / "smoothness.json").write_text(json.dumps({"cosine": [0.1, cosine]}))

    for p, (a, b, t) in zip(deep[:2], [(0.6, 0.5, 0.3), (0.7, 0.6, 0.2)]):
        run(study / "runs" / "supervised" / p.name, 2000, a)
        run(p.run_dir(out), 600, b)
        run(study / "runs" / "mae" / p.name, 5000, t)
    run(study / "runs" / "supervised" / deep[2].name, 2000, 0.9)  # its twin and MAE run missing: left out
    table = by_loss_summary(out, study).splitlines()
    assert len(table) == 3
    assert table[2] == "| supervised | 8 x 48 | 2 | 2000 / 600 | 0.650 / 0.550 | +0.400 / +0.300 |"


def test_by_loss_against_a_folder_without_a_study_is_one_line(tmp_path, capsys):
    from benchmarks.bamboo_cpu_probes import main

    assert main(["by_loss", "--out", str(tmp_path / "probe"), "--study", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"--study {tmp_path / 'nowhere'}: no bamboo_cpu study there (no runs/ folder); run the study into it first"
    )
    assert not (tmp_path / "probe").exists()  # nothing trained, nothing written
