"""CONTRIBUTING.md's worked examples run as written.

Each ```python block that follows an ``<!-- example: NAME -->`` comment is cut out of CONTRIBUTING.md and run,
in order, as the body of one fresh module (its tracebacks point at CONTRIBUTING.md's own lines); the test then
uses the plugin it registered. Whatever an example registers is removed again afterwards, so no plugin leaks
into other tests.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import re
import sys
import tempfile
import types
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import CHANCE

from kilolayer.config import load_config
from kilolayer.data import SOURCES, load_source
from kilolayer.errors import ConfigError
from kilolayer.nn.residual import SCHEMES, Depth, make_scheme
from kilolayer.objectives import OBJECTIVES, build_task
from kilolayer.registry import Registry
from kilolayer.study.findings import FINDINGS
from kilolayer.study.runner import Result
from kilolayer.study.spec import Point, load_spec
from kilolayer.train.engine import seed_everything
from kilolayer.train.run import train
from kilolayer.verdicts.measures import MEASURES
from kilolayer.verdicts.rule import HELD, INCONCLUSIVE

GUIDE = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"
MARKED = re.compile(r"<!-- example: (\w+) -->\n```python\n(.*?)```", re.S)
REGISTRIES = (SCHEMES, OBJECTIVES, SOURCES, FINDINGS, MEASURES)


def blocks(name: str) -> list[tuple[int, str]]:
    """(first line, code) of each block of example ``name``, in the order the guide gives them."""
    text = GUIDE.read_text(encoding="utf-8")
    found = [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in MARKED.finditer(text) if m.group(1) == name]
    assert found, f"CONTRIBUTING.md: no block marked <!-- example: {name} -->"
    return found


@contextmanager
def example(name: str):
    """Run example ``name`` as module ``contributing_NAME``; yields (the module, what it printed)."""
    saved = [(reg, dict(reg._items)) for reg in REGISTRIES]  # a Registry is a Mapping: not hashable
    module = types.ModuleType(f"contributing_{name}")
    module.__file__ = str(GUIDE)
    sys.modules[module.__name__] = module  # pydantic and dataclasses look their module up by name
    printed = io.StringIO()
    try:
        with redirect_stdout(printed):
            for line, code in blocks(name):
                exec(compile("\n" * (line - 1) + code, str(GUIDE), "exec"), module.__dict__)
        yield module, printed.getvalue()
    finally:
        del sys.modules[module.__name__]
        for reg, items in saved:  # the registries exactly as before
            reg._items.clear()
            reg._items.update(items)


def train_records(run: Path, split: str = "train") -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == split]


def first_loss(config) -> float:
    """The loss of step 1 computed apart from the trainer: same seed, same build order, batch of step 0."""
    source = load_source(config)
    seed_everything(config.train.seed)
    task = build_task(config, source)
    with torch.no_grad():
        return float(task(source.train_batch(0, config.train.batch_size))[0])


def test_every_marked_block_is_one_of_the_four_examples():
    names = [m.group(1) for m in MARKED.finditer(GUIDE.read_text(encoding="utf-8"))]
    assert sorted(set(names)) == ["measure", "objective", "scheme", "source"]
    # every ```python block of the guide is marked, so none goes stale unseen
    assert GUIDE.read_text(encoding="utf-8").count("```python") == len(names)


def test_every_registry_the_guide_names(tmp_path):
    text = GUIDE.read_text(encoding="utf-8")
    named = {
        "kilolayer.nn.residual.SCHEMES": "model.scheme",
        "kilolayer.objectives.OBJECTIVES": "objective.name",
        "kilolayer.data.SOURCES": "data.name",
        "kilolayer.study.findings.FINDINGS": "study.findings",
        "kilolayer.study.builtin.BUILTIN": "study",
        "kilolayer.study.analyses.ANALYSES": "analyses",
        "kilolayer.verdicts.measures.MEASURES": "kilolayer.measures",
        "kilolayer.verdicts.contrasts.CONTRASTS": "kilolayer.contrasts",
    }
    for path, field in named.items():
        module, attr = path.rsplit(".", 1)
        registry = getattr(importlib.import_module(module), attr)
        assert isinstance(registry, Registry) and registry.field == field and f"`{path}`" in text, path
    # a study group's analyses are checked against their registry, with its one line
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: s\ngroups: [{name: g, analyses: [smoothnes]}]\n")
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    assert str(err.value) == "analyses='smoothnes': unknown analysis; allowed: smoothness, test_scores"


def test_the_scheme_example(tmp_path):
    with example("scheme") as (mod, printed):
        assert "pre_ln_scaled" in SCHEMES and mod.ScaledPreLN.name == "pre_ln_scaled"
        # the printed std is the init gain the scheme sets: 8 sublayers -> 8^-1/2, times Xavier's sqrt(2 / fans)
        assert float(printed) == pytest.approx(8**-0.5 * math.sqrt(2 / (256 + 64)), rel=0.03)
        model = mod.model
        attn = dict((n, w) for n, w, _ in model.decoder.layers[3].self_attn.branch.weights())
        assert float(attn["o"].detach().std()) == pytest.approx(8**-0.5 * math.sqrt(2 / 128), rel=0.05)
        assert float(attn["q"].detach().std()) == pytest.approx(math.sqrt(2 / 128), rel=0.05)  # not scaled
        # Pre-LN's parts: an LN before each branch, none after the add
        ffn = model.decoder.layers[0].ffn
        assert isinstance(ffn.pre_norm, torch.nn.LayerNorm) and isinstance(ffn.post_norm, torch.nn.Identity)
        # describe reads the same method as the init; `kilolayer describe` prints it (gpt2_small: 24 sublayers)
        assert make_scheme("pre_ln_scaled", Depth("decoder", 0, 12)).describe() == {"decoder": {"gain": 24**-0.5}}
        from kilolayer.cli import main

        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["describe", "gpt2_small", "--set", "model.scheme=pre_ln_scaled"]) == 0
        assert "decoder: gain=0.2041" in out.getvalue()
        # one training step through the trainer: the logged loss is the model's loss on the step's batch
        config = load_config(
            {
                "model": {"arch": "decoder", "scheme": "pre_ln_scaled", "layers": 4, "width": 32, "heads": 2}
                | {"ffn": 64, "vocab_size": 262, "max_len": 32},
                "objective": {"name": "causal_lm"},
                "data": {"name": "stdlib_bytes", "options": {"seq_len": 32, "max_bytes": 100_000, "eval_windows": 8}},
                "train": {"steps": 1, "batch_size": 4, "log_every": 1},
            }
        )
        assert train(config, tmp_path / "run", quiet=True) == {"status": "completed", "step": 1}
        (record,) = train_records(tmp_path / "run")
        assert record["loss"] == pytest.approx(first_loss(config), rel=1e-5)
    assert "pre_ln_scaled" not in SCHEMES


def test_the_objective_example(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the example trains into tempfile.mkdtemp()
    with example("objective") as (mod, printed):
        assert mod.run.is_relative_to(tmp_path)
        assert printed.strip() == "{'status': 'completed', 'step': 2}"
        config = load_config(mod.config)
        losses = [r["loss"] for r in train_records(mod.run)]
        assert len(losses) == 2 and losses[0] == pytest.approx(first_loss(config), rel=1e-5)
        (evaluation,) = train_records(mod.run, "eval")
        assert 0 < evaluation["loss"] < 2 * math.log(262)
        # the mirror image of causal_lm: on a palindrome, with the same weights, the two losses are equal
        task = build_task(config, None)
        lm = build_task(
            config.model_copy(update={"objective": config.objective.model_copy(update={"name": "causal_lm"})}), None
        )
        lm.objective.head.load_state_dict(task.objective.head.state_dict())
        half = torch.randint(0, 262, (3, 8), generator=torch.Generator().manual_seed(0))
        palindromes = {"tokens": torch.cat([half, half.flip(1)], dim=1)}
        with torch.no_grad():
            assert float(task.objective(task.backbone, palindromes)[0]) == pytest.approx(
                float(lm.objective(task.backbone, palindromes)[0]), rel=1e-6
            )
            # and on a sequence that is not one, the reversed loss is causal_lm's loss on the reversed tokens
            x = {"tokens": torch.randint(0, 262, (3, 16), generator=torch.Generator().manual_seed(1))}
            assert float(task.objective(task.backbone, x)[0]) == pytest.approx(
                float(lm.objective(task.backbone, {"tokens": x["tokens"].flip(1)})[0]), rel=1e-6
            )
            logits = task.objective.head(task.backbone(x["tokens"].flip(1)[:, :-1]))
            by_hand = F.cross_entropy(logits.flatten(0, 1), x["tokens"].flip(1)[:, 1:].flatten())
            assert float(task.objective(task.backbone, x)[0]) == pytest.approx(float(by_hand), rel=1e-6)
        assert task.objective.tokens(x) == 3 * 15
        # its chance level is the entropy of the evaluation targets
        y = x["tokens"].flip(1)[:, 1:].flatten()
        p = torch.bincount(y).double() / y.numel()
        p = p[p > 0]
        assert task.objective.chance(task.backbone, [x])["loss"] == pytest.approx(float(-(p * p.log()).sum()))
    assert "reverse_lm" not in OBJECTIVES


def test_the_source_example(tmp_path):
    with example("source") as (mod, printed):
        config, source = mod.config, mod.source
        tokens = source.train_batch(5, 8)["tokens"]
        assert tokens.shape == (8, 16) and tokens.dtype == torch.long
        steps = (tokens[:, 1:] - tokens[:, :-1]) % 16  # each row counts by one stride mod 16
        assert bool((steps == steps[:, :1]).all()) and int(tokens.max()) < 16
        assert str(source.train_batch(0, 2)["tokens"]) in printed
        # a pure function of (seed, step): a second instance agrees, another step or seed does not
        again = load_source(config)
        assert torch.equal(again.train_batch(5, 8)["tokens"], tokens)
        assert not torch.equal(source.train_batch(6, 8)["tokens"], tokens)
        other = load_source(config.model_copy(update={"train": config.train.model_copy(update={"seed": 4})}))
        assert not torch.equal(other.train_batch(5, 8)["tokens"], tokens)
        # two processes each take their half of the same global batch
        shares = [source.train_batch(5, 8, rank, 2)["tokens"] for rank in (0, 1)]
        assert torch.equal(torch.cat(shares), tokens)
        # the evaluation split is fixed and apart from the training examples' stream
        evals = list(source.eval_batches(32))
        assert sum(len(b["tokens"]) for b in evals) == 128
        assert torch.equal(next(again.eval_batches(32))["tokens"], evals[0]["tokens"])
        # the built-in causal_lm trains on it; its first logged loss is the model's loss on batch 0
        assert train(config, tmp_path / "run", quiet=True) == {"status": "completed", "step": 2}
        losses = [r["loss"] for r in train_records(tmp_path / "run")]
        assert len(losses) == 2 and losses[0] == pytest.approx(first_loss(config), rel=1e-5)
        # a model that cannot take the data is refused in one line
        small = config.model_copy(update={"model": config.model.model_copy(update={"vocab_size": 8})})
        with pytest.raises(ConfigError, match=r"^model.vocab_size=8: data.name='counting' needs at least 16$"):
            load_source(small)
    assert "counting" not in SOURCES


def deepnet_results(loss, status=lambda scheme, layers, seed: "completed") -> list[Result]:
    """The ``deepnet`` group of a study: three schemes x 2/6/18 layers x seeds 0 and 1, with made-up final
    losses ``loss(scheme, layers, seed)``; chance levels set, so nothing loads."""
    results = []
    for scheme in ("post_ln", "pre_ln", "deepnorm"):
        for layers in (2, 6, 18):
            for seed in (0, 1):
                values = {"model.scheme": scheme, "model.layers": layers, "train.seed": seed}
                config = load_config(None, [f"{k}={v}" for k, v in values.items()])
                point = Point("deepnet", f"{scheme}_{layers}_s{seed}", values, config)
                st = status(scheme, layers, seed)
                r = Result(
                    point=point, status=st, eval={"loss": loss(scheme, layers, seed)} if st == "completed" else {}
                )
                r.chance = dict(CHANCE)
                results.append(r)
    return results


def test_the_measure_example_and_a_claim_that_reads_it(tmp_path):
    """The guide's measure, read by the claim the guide shows: DeepNorm's exact match 0.90 / 0.92 against Pre-LN's
    0.60 / 0.61 at the deepest setting; a failed run is named; the measure is gone after the example."""
    from kilolayer.verdicts import judge, parse_claim

    def exact(scheme, layers, seed):
        return {"deepnorm": 0.9 + 0.02 * seed, "pre_ln": 0.6 + 0.01 * seed}.get(scheme, 0.0)

    with example("measure") as (mod, _):
        assert "exact_match" in MEASURES
        text = GUIDE.read_text(encoding="utf-8")
        claim_yaml = text.split("```yaml\n", 1)[1].split("```", 1)[0]
        claim = parse_claim(yaml.safe_load(claim_yaml)["claims"][0], "claims[0]")
        group = next(g for g in load_spec("quick").groups if g.name == "deepnet")
        results = deepnet_results(lambda s, n, seed: 0.5)
        for r in results:
            r.eval["exact_match"] = exact(
                r.point.values["model.scheme"], r.point.config.model.layers, r.point.values["train.seed"]
            )
        f = judge(claim, results, group, tmp_path)
        assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(0.305)
        assert f.rule.startswith("d = final exact match (greedy decoding) of model.scheme=deepnorm minus")
        failed = deepnet_results(
            lambda s, n, seed: 0.5, lambda s, n, seed: "failed" if (s, seed) == ("pre_ln", 1) else "completed"
        )
        for r in failed:
            r.eval["exact_match"] = 0.5
        v = judge(claim, failed, group, tmp_path).verdict
        assert v.verdict == INCONCLUSIVE and "(failed" in v.reason
    assert "exact_match" not in MEASURES
