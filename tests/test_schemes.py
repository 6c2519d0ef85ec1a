"""Post-LN-init, R-Fixup, DLCL and BranchNorm beyond one sublayer (formulas: docs/deepnet.md): whole stacks
against their written-out forward, Post-LN-init's divisors and the weights they give, DLCL's combination
weights, R-Fixup's zero branches and scalar biases, BranchNorm's schedule and the step that drives it, and
per-layer compilation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kilolayer import build_model
from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.nn.branchnorm import BranchNormScale, progress
from kilolayer.nn.transformer import set_training_step
from kilolayer.objectives import build_task
from kilolayer.train.parallelize import compile_layers

D, T, S = 16, 5, 4
NEW = ["post_ln_init", "r_fixup", "dlcl", "branchnorm"]
ARCHS = ["encoder", "decoder", "encoder_decoder"]


def model_of(scheme: str, arch: str, n: int = 3, m: int = 2, **extra):
    cfg = dict(arch=arch, scheme=scheme, layers=n, width=D, heads=2, ffn=32, max_len=8, vocab_size=20, **extra)
    if arch == "encoder_decoder":
        cfg["decoder_layers"] = m
    return build_model(cfg)


def ln(x, norm):
    return F.layer_norm(x, (D,), norm.weight, norm.bias, norm.eps)


def ffn_r_fixup(ff, h):
    """R-Fixup's FFN: W2 (act(W1 h + b1 + c1) + c2) + b2, c1 and c2 its scalar biases."""
    hidden = F.gelu(F.linear(h, ff.fc1.weight, ff.fc1.bias) + ff.act_shift) + ff.out_shift
    return F.linear(hidden, ff.fc2.weight, ff.fc2.bias)


def sublayer(scheme, res, x, memory):
    """One residual sublayer of ``scheme`` written out."""
    inputs = {"memory": memory} if res.site.kind == "cross_attn" else {}

    def f(h):
        if scheme == "r_fixup" and res.site.kind == "ffn":
            return ffn_r_fixup(res.branch, h)
        return res.branch(h, **inputs)

    if scheme == "post_ln_init":
        return ln(x + f(x), res.post_norm)
    if scheme == "branchnorm":
        y, lam = f(x), min(int(res.branch_scale.step) / 4000, 1.0)
        return ln(x + y * (y.var(-1, unbiased=False, keepdim=True) + 1e-5) ** (-(1 - lam) / 2), res.post_norm)
    if scheme == "dlcl":
        return x + f(ln(x, res.pre_norm))
    return x + res.branch_scale.weight * f(x + res.shift.bias)  # r_fixup


def written_stack(scheme, stack, x, memory):
    """A whole stack written out: its layers' sublayers, DLCL's combination of every output so far (the
    embedding's unnormalised), and what follows the last layer."""
    if scheme == "dlcl":
        W, norms = stack.history.weights, stack.history.norms
        kept = [x]  # y_0, then LN_k(y_k)
        x = W[0][0] * x
    for layer in stack.layers:
        for res in layer.sublayers():
            x = sublayer(scheme, res, x, memory)
        if scheme == "dlcl":
            kept.append(ln(x, norms[len(kept) - 1]))
            x = sum(W[len(kept) - 1][k] * kept[k] for k in range(len(kept)))
    if scheme == "dlcl":
        return ln(x, stack.final_norm)
    if scheme == "r_fixup":
        out = x + stack.final_norm.bias
        return out * stack.final_norm.scale if stack.side == "encoder" else out
    assert stack.final_norm is None
    return x


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scheme", NEW)
def test_each_stack_forward_is_its_written_out_formula(scheme, arch):
    torch.manual_seed(0)
    model = model_of(scheme, arch).eval()
    with torch.no_grad():  # every parameter away from its start: R-Fixup's zero weights, DLCL's averages, scalars
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.3)
            elif "embed" not in name:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("branch_scale.step"):
                b.fill_(1000)
    memory = torch.randn(2, S, D)
    for stack in model.stacks():
        x = torch.randn(2, T, D)
        with torch.no_grad():
            got = stack(x, memory=memory if stack.side == "decoder" and arch == "encoder_decoder" else None)
            want = written_stack(scheme, stack, x, memory)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- Post-LN-init


@pytest.mark.parametrize("arch", ARCHS)
def test_post_ln_init_divides_layer_l_by_n_minus_l_plus_1(arch):
    """k_l = N - l + 1 for the l-th layer (1-based) of a side with N layers, on every weight of the layer."""
    n, m = 6, 4
    model = model_of("post_ln_init", arch, n=n, m=m)
    for stack in model.stacks():
        N = len(stack.layers)
        assert N == (m if stack.side == "decoder" and arch == "encoder_decoder" else n)
        for i, layer in enumerate(stack.layers):
            l = i + 1  # the paper's 1-based index
            for res in layer.sublayers():
                assert model.scheme.divisor(res.site) == N - l + 1
                for name, _, _ in res.branch.weights():
                    assert model.scheme.init_gain(res.site, name) == 1 / (N - l + 1)


def test_post_ln_init_weights_start_at_xavier_over_k():
    """Each weight's standard deviation is Xavier's sqrt(2 / (fan_in + fan_out)) / k_l, within 6% (a 64x64
    slice has 4,096 draws: the sampled std's own relative error is about 1.1%)."""
    torch.manual_seed(0)
    model = build_model(
        dict(arch="encoder_decoder", scheme="post_ln_init", layers=6, decoder_layers=3, width=64, heads=4, ffn=128)
    )
    for stack in model.stacks():
        N = len(stack.layers)
        for i, layer in enumerate(stack.layers):
            for res in layer.sublayers():
                for name, w, _ in res.branch.weights():
                    fan_out, fan_in = w.shape
                    want = math.sqrt(2 / (fan_in + fan_out)) / (N - i)
                    assert w.std().item() == pytest.approx(want, rel=0.06), (stack.side, i, res.site.kind, name)


# ---------------------------------------------------------------- DLCL


@pytest.mark.parametrize("arch", ARCHS)
def test_dlcl_weights_start_at_the_average_and_learn(arch):
    """Each stack has its own combination: the input of layer l + 1 (and, last, the stack's output) weighs
    the l + 1 outputs so far by 1 / (l + 1); every weight receives a gradient."""
    torch.manual_seed(0)
    model = model_of("dlcl", arch, n=3, m=2)
    tokens = torch.randint(0, 20, (2, T))
    out = model(tokens, tokens) if arch == "encoder_decoder" else model(tokens)
    (out * torch.randn_like(out)).sum().backward()
    histories = [stack.history for stack in model.stacks()]
    assert len({id(h) for h in histories}) == len(histories)
    for stack in model.stacks():
        rows = stack.history.weights
        assert len(rows) == len(stack.layers) + 1 and len(stack.history.norms) == len(stack.layers)
        for l, row in enumerate(rows):
            assert torch.equal(row.detach(), torch.full((l + 1,), 1 / (l + 1)))
            assert row.grad is not None and torch.all(row.grad != 0), (stack.side, l, row.grad)


def test_dlcl_stack_observes_each_layers_own_output():
    """``observe(i, h)``: the embedding output at 0, layer i's own output y_i below the top (not the combination
    the next layer reads), the stack's output at N; with ``before_final_norm``, y_N in its place."""
    torch.manual_seed(0)
    stack = model_of("dlcl", "encoder", n=3).encoder.eval()
    x = torch.randn(2, T, D)
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, a, y: outputs.append(y)) for layer in stack.layers]
    seen, before = {}, {}

    def observer(i, h):
        seen[i] = h

    def observer_before(i, h):
        before[i] = h

    observer_before.before_final_norm = True
    with torch.no_grad():
        out = stack(x, observe=observer)
        stack(x, observe=observer_before)
    for h in hooks:
        h.remove()
    assert sorted(seen) == sorted(before) == [0, 1, 2, 3]
    assert seen[0] is x and seen[1] is outputs[0] and seen[2] is outputs[1] and seen[3] is out
    assert before[3] is outputs[5] and not torch.equal(before[3], out)


# ---------------------------------------------------------------- R-Fixup


def test_r_fixup_starts_as_the_identity_with_fixup_scales():
    """Zero O and W2 make every branch start at zero, so each stack passes its input through (encoder: times
    its scale 1); Q, K, V are Xavier-uniform over the fused (3d, d) matrix times L^(-1/6), W1 Xavier-uniform
    times L^(-1/2), L = 2N + 3M branches."""
    torch.manual_seed(0)
    n, m = 4, 3
    model = build_model(
        dict(arch="encoder_decoder", scheme="r_fixup", layers=n, decoder_layers=m, width=64, heads=4, ffn=128)
    )
    L = 2 * n + 3 * m
    for stack in model.stacks():
        x = torch.randn(2, T, 64)
        memory = torch.randn(2, S, 64) if stack.side == "decoder" else None
        with torch.no_grad():
            assert torch.equal(stack(x, memory=memory), x)
        for layer in stack.layers:
            for res in layer.sublayers():
                for name, w, b in res.branch.weights():
                    fan = 4 * 64 if name in "qkv" else sum(w.shape)  # Q, K, V: fan_in d + fan_out 3d
                    bound = math.sqrt(6 / fan) * {"o": 0, "w2": 0, "w1": L**-0.5}.get(name, L ** (-1 / 6))
                    assert w.abs().max().item() <= bound
                    assert bound == 0 or w.abs().max().item() > 0.9 * bound  # uniform: it reaches its bound
                    assert b is None or not b.any()
                assert res.shift.bias.item() == 0 and res.branch_scale.weight.item() == 1
    assert model.scheme.branches == L


def test_r_fixup_qkv_has_the_std_of_the_fixup_codes_fused_in_projection():
    """Fixup's transformer_zero.py runs Xavier-uniform on the (3d, d) in-projection, then times L^(-1/6): at
    width 256 and L = 30, std sqrt(6 / 4d) / sqrt(3) * 30^(-1/6) = 0.02507 (per-slice Xavier would give 0.03546)."""
    torch.manual_seed(0)
    model = build_model(dict(arch="encoder", scheme="r_fixup", layers=15, width=256, heads=4, ffn=256))
    assert model.scheme.branches == 30
    qkv = torch.cat([layer.self_attn.branch.qkv.weight for layer in model.encoder.layers])
    assert math.sqrt(6 / (4 * 256)) / math.sqrt(3) * 30 ** (-1 / 6) == pytest.approx(0.02507, abs=1e-5)
    assert qkv.std().item() == pytest.approx(0.02507, rel=0.005)
    assert qkv.abs().max().item() == pytest.approx(math.sqrt(6 / (4 * 256)) * 30 ** (-1 / 6), rel=1e-3)


# ---------------------------------------------------------------- BranchNorm


def test_branchnorm_follows_its_schedule():
    """lambda_t = min(t / T, 1); the branch is normalised to unit variance per token at t = 0, scaled by
    (Var + eps)^(-(1 - lambda) / 2) on the way, and left exactly as it is from t = T."""
    steps = 400
    for t, lam in ((0, 0.0), (1, 1 / 400), (100, 0.25), (200, 0.5), (400, 1.0), (800, 1.0)):
        assert progress(t, steps) == lam
    scale = BranchNormScale(steps, 1e-5)
    y = 3.0 * torch.randn(4, 7, 32) + 0.5
    var = y.var(-1, unbiased=False, keepdim=True)
    scale.step.fill_(0)
    assert torch.allclose((y * (var + 1e-5) ** -0.5).var(-1, unbiased=False), torch.ones(4, 7), atol=1e-4)
    torch.testing.assert_close(scale(y), y / torch.sqrt(var + 1e-5))
    scale.step.fill_(100)
    torch.testing.assert_close(scale(y), y * (var + 1e-5) ** -0.375)
    for t in (400, 401, 10_000):
        scale.step.fill_(t)
        assert torch.equal(scale(y), y)


def test_the_training_step_reaches_every_branchnorm_sublayer():
    """set_training_step, given a module holding backbones (a task), sets each BranchNorm sublayer's step;
    other schemes ignore it. The step is an integer buffer: in the state dict, exact at any step."""
    holder = torch.nn.ModuleDict({"a": model_of("branchnorm", "encoder_decoder"), "b": model_of("dlcl", "decoder")})
    set_training_step(holder, 123_457)
    scales = [m for m in holder.modules() if isinstance(m, BranchNormScale)]
    assert len(scales) == 2 * 3 + 3 * 2 and all(int(s.step) == 123_457 for s in scales)
    state = holder["a"].state_dict()
    steps = {k: v for k, v in state.items() if k.endswith("branch_scale.step")}
    assert len(steps) == len(scales) and all(v.dtype == torch.long and int(v) == 123_457 for v in steps.values())
    holder.to(torch.bfloat16)
    assert all(s.step.dtype == torch.long and int(s.step) == 123_457 for s in scales)


def test_branchnorm_describes_its_steps():
    model = model_of("branchnorm", "decoder", branchnorm_steps=250)
    assert model.scheme.describe() == {"all": {"T": 250}}
    assert {res.branch_scale.steps for layer in model.decoder.layers for res in layer.sublayers()} == {250}


# ---------------------------------------------------------------- compilation


def seq2seq_task(scheme: str):
    cfg = load_config(
        {
            "model": {
                "arch": "encoder_decoder",
                "scheme": scheme,
                "layers": 2,
                "decoder_layers": 2,
                "width": 32,
                "heads": 4,
                "ffn": 64,
                "vocab_size": 16,
                "max_len": 16,
            },
            "objective": {"name": "seq2seq"},
            "data": {"name": "synthetic", "task": "reverse"},
        }
    )
    source = load_source(cfg)
    torch.manual_seed(0)
    return build_task(cfg, source), source.train_batch(0, 4)


def test_per_layer_compile_follows_the_branchnorm_step_without_recompiling():
    """``train.compile: layers`` (aot_eager: the same graphs without a C++ build) gives the eager output at two
    points of BranchNorm's schedule; the step is a tensor, so moving it recompiles nothing."""
    from torch._dynamo.utils import counters

    task, batch = seq2seq_task("branchnorm")
    backbone, src, tgt = task.backbone.eval(), batch["src"], batch["tgt_in"]
    with torch.no_grad():
        eager = [backbone(src, tgt)]
        set_training_step(task, 2000)
        eager.append(backbone(src, tgt))
        set_training_step(task, 0)
        torch._dynamo.reset()
        counters.clear()
        compile_layers(task, backend="aot_eager")
        compiled = [backbone(src, tgt)]
        graphs = counters["stats"]["unique_graphs"]
        set_training_step(task, 2000)
        compiled.append(backbone(src, tgt))
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs
    assert not torch.allclose(eager[0], eager[1], atol=1e-3)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["r_fixup", "dlcl", "branchnorm"])
def test_a_whole_task_compiles_to_one_graph(scheme):
    """``train.compile: model`` traces DLCL's layer history, R-Fixup's scalars and BranchNorm's step-driven
    scale into one graph, with no break."""
    task, batch = seq2seq_task(scheme)
    task.train()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(task.compute)(task.objective.prepare(batch))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
