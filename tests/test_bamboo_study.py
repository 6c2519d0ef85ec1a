"""The built-in Bamboo studies (``bamboo`` for one GPU, ``bamboo_cpu`` its slice for 2 cores): every config is
valid, every finding finds the groups it compares, and the depths are a fair comparison. No training."""

from __future__ import annotations

import pytest

from kilolayer.data.options import parse_options
from kilolayer.data.ptb import PTBOptions, _window_len
from kilolayer.data.vocab import BYTE_VOCAB
from kilolayer.nn.budget import count_parameters
from kilolayer.study.builtin import BUILTIN
from kilolayer.study.findings import DEPTH_PAIRS, LOSS_GROUPS, SMOOTHING_PAIRS, UNTRAINED
from kilolayer.study.spec import expand, load_spec

STUDIES = ("bamboo", "bamboo_cpu")
TRAINED = sorted(
    {g for seq, tok, _ in SMOOTHING_PAIRS for g in (seq, tok)}
    | {g for scratch, tuned, _, _ in DEPTH_PAIRS for g in (scratch, tuned)}
    | set(LOSS_GROUPS)
)


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
    assert cpu.expected_minutes is not None and cpu.expected_minutes <= 90
    # measured when it was run here, with the estimate it replaced
    assert "measured" in cpu.expected_basis and "estimated beforehand" in cpu.expected_basis
    assert "estimated" in load_spec("bamboo").expected_basis


def test_every_finding_finds_its_groups(study):
    spec, points = study
    names = [g.name for g in spec.groups]
    for group in [*TRAINED, *UNTRAINED.values()]:
        assert group in names, (spec.name, group)
        mine = [p for p in points if p.group == group]
        shapes = {_shape(p) for p in mine}
        seeds = {p.values["train.seed"] for p in mine}
        assert len(shapes) >= 4, (spec.name, group, shapes)
        if group not in UNTRAINED.values():
            assert len(seeds) >= 2, (spec.name, group, seeds)
            # every shape is trained with every seed: the findings pair runs by depth and seed
            assert len(mine) == len(shapes) * len(seeds), (spec.name, group)
    # one set of shapes for the whole study, so each pair compares the same depths
    assert len({frozenset(_shape(p) for p in points if p.group == g) for g in names}) == 1
    assert {"bamboo_smoothing", "bamboo_depth", "bamboo_depth_tokens"} <= set(spec.findings)


def test_shapes_are_parameter_matched_with_one_head_size(study):
    spec, points = study
    for group in {p.group for p in points}:
        mine = {_shape(p): p.config.model for p in points if p.group == group}
        counts = [count_parameters(m) for m in mine.values()]
        assert max(counts) / min(counts) < 1.05, (spec.name, group, counts)
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


def test_text_is_penn_treebank_bytes_and_fits_the_model(study):
    spec, points = study
    for p in points:
        cfg = p.config
        if p.group in ("mlm", "next_token"):
            assert cfg.data.name == "ptb"
            opts = parse_options(PTBOptions, cfg.data.options, "data.options")
            assert opts.level == "bytes" and cfg.model.vocab_size >= BYTE_VOCAB
            _window_len(cfg, opts)  # raises if the objective reads more than model.max_len
        if p.group in ("text_classify", "mlm_finetune", "text_untrained"):
            assert cfg.data.name == "stdlib_packages"
            assert cfg.data.options["seq_len"] <= cfg.model.max_len
        if p.group in ("supervised", "finetune", "mae", "contrastive", "untrained"):
            assert cfg.data.name in ("mnist", "mnist_captions") and cfg.model.image_size == 28


def test_every_trained_point_stops_at_its_plateau_within_its_budget(study):
    spec, points = study
    for p in points:
        tc = p.config.train
        if p.group in UNTRAINED.values():
            assert tc.steps == 0
            continue
        assert tc.patience >= 2 and tc.eval_every > 0, p.key
        # room for the plateau to show up before the budget ends
        assert tc.patience * tc.eval_every <= tc.steps // 2, p.key
        assert tc.schedule != "cosine", p.key  # a budget-shaped schedule would make stopping early unfair
        metric = tc.early_stop_metric
        if p.config.objective.name == "classification":
            assert metric == "accuracy", p.key  # what bamboo_depth compares
        else:
            assert metric == "loss", p.key
