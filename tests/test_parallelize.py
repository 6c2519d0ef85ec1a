"""kilolayer.train.parallelize: activation checkpointing applied from outside the model trains exactly as the plain
model does (same losses and gradients, bit for bit), keeps what the memory estimate says, and leaves parameter
names alone (a contrastive text tower too, when its own model section asks); the objective contract is enforced
when a class is defined."""

from __future__ import annotations

import pytest
import torch
from objective_helpers import WHOLE_TASKS

from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.errors import InputError
from kilolayer.objectives import Objective, build_task
from kilolayer.train import distributed as D
from kilolayer.train.engine import split_batch
from kilolayer.train.host.memory import estimate_memory
from kilolayer.train.parallelize import compile_model, parallelize, transformer_layers

S2S = {"arch": "encoder_decoder", "layers": 3, "decoder_layers": 3, "width": 32, "heads": 4, "ffn": 64}


def _config(checkpoint: bool, dropout: float = 0.0, scheme: str = "deepnorm"):
    return load_config(
        {
            "model": {**S2S, "scheme": scheme, "dropout": dropout, "checkpoint_activations": checkpoint},
            "objective": {"name": "seq2seq"},
            "data": {"name": "synthetic", "task": "reverse"},
            "train": {"batch_size": 8, "accumulate": 2, "seed": 0},
        }
    )


def _train(checkpoint: bool, steps: int = 3, dropout: float = 0.0, scheme: str = "deepnorm"):
    """(losses, final gradients by name, calls of the first layer's first Linear) of ``steps`` AdamW steps."""
    cfg = _config(checkpoint, dropout, scheme)
    source = load_source(cfg)
    torch.manual_seed(0)
    task = build_task(cfg, source)
    model = parallelize(task, cfg, D.Dist())
    calls = []
    first = next(m for m in transformer_layers(task.backbone)[0].modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_pre_hook(lambda m, a: calls.append(1))  # inside the layer: recomputation runs it
    opt = torch.optim.AdamW(task.parameters(), lr=1e-3)
    model.train()
    losses, grads = [], {}
    for step in range(steps):
        micro = split_batch(source.train_batch(step, 8), 2)
        for mb in micro:
            loss, _ = model(mb)
            (loss / len(micro)).backward()
            losses.append(float(loss.detach()))
        grads = {n: p.grad.clone() for n, p in task.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, len(calls)


@pytest.mark.parametrize(
    "dropout, scheme",
    [(0.0, "deepnorm"), (0.1, "deepnorm"), (0.1, "post_ln_init"), (0.1, "r_fixup"), (0.1, "dlcl"), (0.1, "branchnorm")],
)
def test_checkpointed_training_is_plain_training_bit_for_bit(dropout, scheme):
    """Recomputation replays the forward's random state, so dropout is recomputed identically too; DLCL's
    combination of layers sits between the recomputed layers."""
    plain_losses, plain_grads, plain_calls = _train(False, dropout=dropout, scheme=scheme)
    ckpt_losses, ckpt_grads, ckpt_calls = _train(True, dropout=dropout, scheme=scheme)
    assert ckpt_losses == plain_losses
    assert ckpt_grads.keys() == plain_grads.keys() and len(plain_grads) > 10
    for name, g in plain_grads.items():
        assert torch.equal(ckpt_grads[name], g), name
    # each layer's forward runs once per micro-batch, and once more for the backward when checkpointed
    assert plain_calls == 6 and ckpt_calls == 12


DEC = {"arch": "decoder", "width": 32, "heads": 4, "ffn": 64, "max_len": 32, "vocab_size": 300}


def _saved_bytes(layers: int, checkpoint: bool, B: int = 4, T: int = 32) -> int:
    """Bytes of the distinct tensors autograd keeps over one forward pass of a decoder, parameters excluded."""
    model = {**DEC, "layers": layers, "checkpoint_activations": checkpoint}
    cfg = load_config({"model": model, "objective": {"name": "causal_lm"}, "data": {"name": "synthetic"}})
    torch.manual_seed(0)
    task = build_task(cfg, None)  # the model alone: the batch is made here
    model = parallelize(task, cfg, D.Dist()).train()
    params = {p.untyped_storage().data_ptr() for p in task.parameters()}
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    batch = {"tokens": torch.randint(5, 300, (B, T)), "padding_mask": torch.zeros(B, T, dtype=torch.bool)}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch)
    return sum(v for k, v in kept.items() if k not in params)


def test_a_checkpointed_layer_keeps_only_its_input():
    """Four more checkpointed layers keep about four more fp32 (B, T, width) inputs and nothing else (what the
    memory estimate assumes); without checkpointing they keep far more."""
    hidden = 4 * 32 * DEC["width"] * 4
    assert _saved_bytes(8, True) - _saved_bytes(4, True) == pytest.approx(4 * hidden, rel=0.05)  # measured: 0.97
    assert _saved_bytes(8, False) - _saved_bytes(4, False) > 10 * 4 * hidden


def test_parameter_names_and_state_dict_do_not_change():
    cfg = _config(True)
    source = load_source(cfg)
    task = build_task(cfg, source)
    before = list(task.state_dict())
    parallelize(task, cfg, D.Dist())
    parallelize(task, cfg, D.Dist())  # a second time changes nothing either
    assert list(task.state_dict()) == before
    assert [n for n, _ in task.named_modules()] == [n for n, _ in build_task(cfg, source).named_modules()]


def _clip_step(text_checkpoint: bool, image_checkpoint: bool = False):
    """(config, loss, gradients by name, forward calls of the image and text towers' first layers) of one
    training step of a tiny CLIP, with dropout on (recomputation must replay it)."""
    image = {"input": "patches", "channels": 1, "image_size": 8, "patch_size": 2, "width": 32, "heads": 4}
    text = {"layers": 2, "width": 32, "heads": 4, "checkpoint_activations": text_checkpoint}
    cfg = load_config(
        {
            "model": {**image, "ffn": 64, "layers": 2, "dropout": 0.1, "checkpoint_activations": image_checkpoint},
            "objective": {"name": "contrastive", "options": {"embed_dim": 16, "text_model": text}},
            "data": {"name": "digit_captions"},
            "train": {"batch_size": 8, "seed": 0},
        }
    )
    source = load_source(cfg)
    torch.manual_seed(0)
    task = build_task(cfg, source)
    model = parallelize(task, cfg, D.Dist()).train()
    calls = {"image": 0, "text": 0}
    for tower, backbone in (("image", task.backbone), ("text", task.objective.text)):
        first = next(m for m in transformer_layers(backbone)[0].modules() if isinstance(m, torch.nn.Linear))
        first.register_forward_pre_hook(lambda m, a, tower=tower: calls.__setitem__(tower, calls[tower] + 1))
    loss, _ = model(source.train_batch(0, 8))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in task.named_parameters() if p.grad is not None}
    return cfg, float(loss.detach()), grads, calls


def test_the_contrastive_text_tower_is_checkpointed_when_its_options_say_so():
    """objective.options.text_model.checkpoint_activations recomputes the text tower's layers (and only
    them) in the backward pass, with the loss and every gradient exactly those of the plain step."""
    cfg_off, loss_off, grads_off, calls_off = _clip_step(False)
    cfg_on, loss_on, grads_on, calls_on = _clip_step(True)
    assert calls_off == {"image": 1, "text": 1}
    assert calls_on == {"image": 1, "text": 2}
    assert loss_on == loss_off
    assert grads_on.keys() == grads_off.keys() and any(n.startswith("objective.text.") for n in grads_on)
    for name, g in grads_off.items():
        assert torch.equal(grads_on[name], g), name
    # model.checkpoint_activations is the image tower's alone
    _, loss_image, _, calls_image = _clip_step(False, image_checkpoint=True)
    assert calls_image == {"image": 2, "text": 1} and loss_image == loss_off
    # and the memory estimate counts the text tower as checkpointed
    assert estimate_memory(cfg_on)["activations"] < estimate_memory(cfg_off)["activations"]


# ---------------------------------------------------------------- the objective contract


def test_an_objective_missing_a_required_method_is_refused_at_definition():
    with pytest.raises(TypeError, match=r"^objective NoTokens: does not implement tokens\(\)"):

        class NoTokens(Objective):
            name = "no_tokens"

            def forward(self, backbone, batch):
                return torch.zeros(()), {}

            def represent(self, backbone, batch):
                return torch.zeros(())

    with pytest.raises(TypeError, match=r"^objective NoForward: does not implement forward\(\)"):

        class NoForward(Objective):
            def represent(self, backbone, batch):
                return torch.zeros(())

            def tokens(self, batch):
                return 0

    class Base(Objective, abstract=True):  # a shared base may leave them to its subclasses
        def tokens(self, batch):
            return 0

    class Complete(Base):
        def forward(self, backbone, batch):
            return torch.zeros(()), {}

        def represent(self, backbone, batch):
            return torch.zeros(())

    assert Complete.tokens is Base.tokens


@pytest.mark.parametrize("name", WHOLE_TASKS)
def test_a_whole_task_compiles_to_one_graph(name):
    """``train.compile: model`` traces :meth:`Task.compute` as one graph for every objective: the objective's
    ``prepare`` draws the step's masks (a CPU generator seeded by a value read out of the global RNG) and MLM's
    index list (its length depends on the data) eagerly first; stats stay tensors until the task reads them out;
    the embedding's id-range check runs in eager mode only, where it still refuses ids outside the vocabulary
    with the field's name."""
    cfg = load_config(WHOLE_TASKS[name])
    source = load_source(cfg)
    task = build_task(cfg, source).train()
    batch = source.train_batch(0, 4)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(task.compute)(task.objective.prepare(batch))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    if cfg.model.input == "tokens":
        key = "tokens" if "tokens" in batch else "src"
        bad = {**batch, key: batch[key].clone().fill_(cfg.model.vocab_size)}
        with pytest.raises(InputError, match=rf"ids must lie in \[0, {cfg.model.vocab_size}\)"):
            task(bad)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlm", "mae", "contrastive"])
def test_a_compiled_task_trains_as_the_eager_one(name):
    """Five steps from the same seed, eager and under ``train.compile: model`` (aot_eager: the same graph without
    a C++ build): the same losses and stats, the same weights after, though MLM selects another number of
    positions each step; that varying length compiles at most twice (static, then dynamic), never per step."""
    from torch._dynamo.utils import counters

    def run(compiled: bool):
        cfg = load_config(WHOLE_TASKS[name])
        source = load_source(cfg)
        torch.manual_seed(0)
        task = build_task(cfg, source).train()
        if compiled:
            compile_model(task, backend="aot_eager")
            prepare = task.objective.prepare

            def recording(batch):  # Task.forward's eager call draws; forward's own call, in the graph, returns
                if "mlm_drawn" in batch or name != "mlm":
                    return prepare(batch)
                out = prepare(batch)
                selected.append(out["mlm_drawn"][1].numel())
                return out

            task.objective.prepare = recording
        opt = torch.optim.AdamW(task.parameters(), lr=1e-3)
        torch.manual_seed(1)
        history = []
        for step in range(5):
            loss, stats = task(source.train_batch(step, 8))
            loss.backward()
            opt.step()
            opt.zero_grad()
            history.append((float(loss.detach()), stats))
        return history, task.state_dict()

    selected = []
    torch._dynamo.reset()
    counters.clear()
    (eager, eager_weights), (compiled, compiled_weights) = run(False), run(True)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    for (a, sa), (b, sb) in zip(eager, compiled):
        assert b == pytest.approx(a, rel=1e-5) and sb.keys() == sa.keys()
        assert all(isinstance(v, float) and v == pytest.approx(sa[k], rel=1e-5, abs=1e-6) for k, v in sb.items())
    for key, w in eager_weights.items():
        torch.testing.assert_close(compiled_weights[key], w, rtol=1e-4, atol=1e-5)
    if name == "mlm":  # the point of the dynamic length: the compiled steps selected different numbers
        assert len(set(selected)) > 1, selected


@pytest.mark.parametrize("name", ["mae", "contrastive"])
def test_per_layer_compile_reaches_the_objectives_own_towers(name):
    """``train.compile: layers`` compiles every Transformer layer the task trains: the backbone's, MAE's decoder's
    and the contrastive text tower's (4 of 4 and 6 of 6 layers, not the backbone's 2 alone)."""
    from kilolayer.nn.layers import Layer

    cfg = load_config({**WHOLE_TASKS[name], "train": {"compile": "layers"}})
    task = build_task(cfg, load_source(cfg))
    layers = [m for m in task.modules() if isinstance(m, Layer)]
    assert len(layers) > len(transformer_layers(task.backbone))
    parallelize(task, cfg, D.Dist())
    assert all(getattr(m, "_compiled_call_impl", None) is not None for m in layers)
