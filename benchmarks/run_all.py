"""Run every benchmark and regenerate docs/benchmarks.md (tables, machine, versions, commands, date).

    python -m benchmarks.run_all --out docs/benchmarks.md [--json FILE] [--smoke] [--fast-precision auto|bf16|fp32]

The raw results go to ``--json`` (default: the Markdown path with ``.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import attention, common, heap, memory, profile_step, side_by_side, study_points, train_step

GiB = 1024**3


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _variant(res: dict, name: str) -> dict | None:
    return next((v for v in res["variants"] if v["name"] == name and "tokens_per_s" in v), None)


#: the targets the generated page checks
EAGER_GOAL = 1.05  # kilolayer eager fp32 / the faster peer's eager fp32
FAST_GOAL = 1.05  # kilolayer's best fast path / the best peer on the same fast path
MFU_GOAL = 0.30  # kilolayer's best fast path at the first config (d=256 x 12), share of the measured bf16 peak
MEMORY_GOAL_GIB = 1.6  # checkpointed d=64 x 1000L decoder and 500L-500L encoder-decoder steps
SIDE_BY_SIDE_GOAL = 1.5  # two runs at once (train.threads: auto, or a study at --jobs 2) / one run alone
ALONE_NOISE = 0.1  # one run alone at auto / with every core: no slower than this beyond 1


def _kilolayer_fast(res: dict) -> list[dict]:
    """kilolayer's timed fast-path rows (one per compile mode), fastest first."""
    rows = [
        v
        for v in res["variants"]
        if v["peer"] == "kilolayer" and common.StepOptions(**v["options"]).fast and "tokens_per_s" in v
    ]
    return sorted(rows, key=lambda v: v["step_ms"])


def _rematch(res: dict) -> dict | None:
    """``res``'s rematch (:func:`benchmarks.common.rematch`) where it ran to the end."""
    m = res.get("rematch")
    return m if m and "error" not in m else None


def _rematch_text(ts: dict) -> list[str]:
    """What the fast-path targets read, where a rematch decided them."""
    if not any(_rematch(res) for res in ts["configs"].values()):
        return []
    return [
        "The fast-path targets read a rematch, run after the race: kilolayer's fastest fast-path row against",
        f"every peer fast-path row within {common.REMATCH_PEER_SPREAD:.0%} of the fastest one, more rounds, each",
        "row's timed step after an untimed one of its own (in the race every step follows another model's, each",
        "row always the same one), the order rotating. The figure is the median of the per-round ratios against",
        "the strongest of those peers, with the sign test's interval of that median; a target is met where the",
        "interval's lower end reaches it. The rematch's line under each table gives every peer's figure and the",
        "medians of the rounds where each side went first.",
    ]


def _mode(row: dict) -> str:
    return f"compile: {row['options']['compile']}"


def _mfu_target(ts: dict, res: dict) -> dict | None:
    """The MFU goal (a share of the bf16 peak) at ``res``'s config. Where the fast path ran in fp32 the goal
    stands and is not met: the row says why bf16 was not used and what the fp32 fast path reached."""
    fast = _kilolayer_fast(res)
    if not fast:
        return None
    best = max(fast, key=lambda v: v["mfu"])
    target = f"{res['label']}: fast-path MFU >= {MFU_GOAL:.0%} of the measured bf16 peak"
    if best["options"]["precision"] == "bf16":
        return {"target": target, "measured": f"{_pct(best['mfu'])} ({_mode(best)})", "met": best["mfu"] >= MFU_GOAL}
    peaks, flags = ts["peak_flops"], ts["machine"]["flags"]
    attained = f"fp32 fast path {_pct(best['mfu'])} of the fp32 peak ({_mode(best)})"
    if peaks["bf16"] < peaks["fp32"]:
        measured = (
            f"not attainable on this CPU: bf16 GEMM {common.gflops(peaks['bf16'])} GFLOP/s vs fp32 "
            f"{common.gflops(peaks['fp32'])} GFLOP/s ({common.bf16_support(flags)}); best attainable: {attained}"
        )
    else:
        measured = (
            f"not measured: the fast path ran in fp32 (--fast-precision fp32) though bf16 GEMM is "
            f"{common.times(peaks['bf16'] / peaks['fp32'])} fp32's; {attained}"
        )
    return {"target": target, "measured": measured, "met": False}


def side_by_side_targets(sb: dict | None) -> list[dict]:
    """Per shape: two runs side by side within :data:`SIDE_BY_SIDE_GOAL` x one alone, at ``train.threads: auto`` (over
    the faster of its own run alone and the default count's, repeat by repeat) and inside a study at ``--jobs 2``;
    and one run alone at the default count (every core) within :data:`ALONE_NOISE` of the fastest count's."""
    out = []
    rows = sb["rows"] if sb else []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = {r["threads"]: r for r in rows if r["shape"] == shape}
        every = next(r for name, r in mine.items() if name.startswith("every core"))
        for name in ("auto", side_by_side.STUDY):
            if name not in mine:
                continue
            row, measured = mine[name], f"{mine[name]['ratio']:.2f}x"
            ratio = row["ratio"]
            if name == "auto":
                # on an idle machine auto takes every core: a slow run alone must not flatter the pair (over the
                # faster run alone of each repeat, the ratio can only grow)
                ratio = _pair_over_alone(row, every, own=True)
                measured += f"; over the faster run alone, auto's or every core's: {ratio:.2f}x"
                if "one thread" in mine:  # what no policy can beat: one core each
                    floor = _pair_over_alone(mine["one thread"], every, own=False)
                    measured += f"; two one-thread runs over every core alone: {floor:.2f}x"
            out.append(
                {
                    "target": f"{shape}: two runs side by side <= {SIDE_BY_SIDE_GOAL}x one alone's time ({name})",
                    "measured": f"{measured} (every core side by side: {every['ratio']:.2f}x)",
                    "met": ratio <= SIDE_BY_SIDE_GOAL,
                }
            )
        # the fixed counts (auto follows the load: a policy, not a count)
        counts = {n: r for n, r in mine.items() if n not in (side_by_side.STUDY, "auto")}
        fastest = min(counts, key=lambda n: counts[n]["alone_s"])
        alone = every["alone_s"] / counts[fastest]["alone_s"]
        out.append(
            {
                "target": f"{shape}: one run alone at the default count (every core) within {ALONE_NOISE:.0%} of the "
                "fastest count's time",
                "measured": f"{alone:.2f}x ({fastest} fastest)",
                "met": alone <= 1 + ALONE_NOISE,
            }
        )
    return out


def _pair_over_alone(row: dict, every: dict, own: bool) -> float:
    """``row``'s pair time over ``every``'s run alone, or over the faster of it and ``row``'s own if ``own``:
    repeat by repeat (the median of the ratios) where both rows kept their runs, else of the medians."""
    pairs, every_alone = row.get("side_by_side_runs"), every.get("alone_runs")
    alone = row.get("alone_runs") if own else every_alone
    if pairs and alone and every_alone and len(pairs) == len(alone) == len(every_alone):
        return side_by_side.paired_ratio(pairs, [min(a, b) for a, b in zip(alone, every_alone, strict=True)])
    return row["side_by_side_s"] / min(row["alone_s"] if own else every["alone_s"], every["alone_s"])


def targets(ts: dict, mem: dict, sb: dict | None = None) -> list[dict]:
    """Each target with the measured figure and whether it was met."""
    out = side_by_side_targets(sb)
    words = train_step.fast_path_words(train_step.fast_precision(ts))
    for _key, res in ts["configs"].items():
        eager = _variant(res, "kilolayer")
        if eager and "ratio_vs_faster_peer" in eager:
            r = eager["ratio_vs_faster_peer"]
            out.append(
                {
                    "target": f"{res['label']}: kilolayer eager fp32 >= {EAGER_GOAL:.2f}x the faster peer's "
                    f"({res['faster_peer']})",
                    "measured": f"{r:.2f}x",
                    "met": r >= EAGER_GOAL,
                }
            )
        fast = [v for v in _kilolayer_fast(res) if "ratio_vs_best_peer_fast" in v]
        if fast:
            best = max(fast, key=lambda v: v["ratio_vs_best_peer_fast"])
            r, how = best["ratio_vs_best_peer_fast"], _mode(best)
            met = r >= FAST_GOAL
            m = _rematch(res)
            if m:  # the rows timed again: the strongest peer's figure decides, by its interval's lower end
                best = _variant(res, m["kilolayer"])
                r, met = m["ratio"], m["interval"][0] >= FAST_GOAL
                how = f"{_mode(best)}; against {m['peer']}, {m['rounds']} rounds, {common.interval_words(m)}"
            out.append(
                {
                    "target": f"{res['label']}: kilolayer's best fast path >= {FAST_GOAL:.2f}x the best peer on the "
                    f"same fast path, {words} ({res['best_peer_fast']})",
                    "measured": f"{r:.2f}x ({how})",
                    "met": met,
                }
            )
    mfu = _mfu_target(ts, ts["configs"][next(iter(ts["configs"]))])
    if mfu:
        out.append(mfu)
    deepest = [r for r in mem["rows"] if r["peer"] == "kilolayer" and r["checkpoint"] and "peak_gib" in r]
    if deepest:
        d = max(deepest, key=lambda r: r["layers"])
        out.append(
            {
                "target": f"{d['label']} decoder, checkpointed step <= {MEMORY_GOAL_GIB} GiB peak",
                "measured": f"{d['peak_gib']:.2f} GiB",
                "met": d["peak_gib"] <= MEMORY_GOAL_GIB,
            }
        )
    for r in mem.get("encoder_decoder", []):
        if "peak_gib" in r:
            out.append(
                {
                    "target": f"{r['label']} encoder-decoder, checkpointed step <= {MEMORY_GOAL_GIB} GiB peak",
                    "measured": f"{r['peak_gib']:.2f} GiB",
                    "met": r["peak_gib"] <= MEMORY_GOAL_GIB,
                }
            )
    return out


def _profile_row(prof: dict, config: str, peer: str, fast: bool) -> dict | None:
    for r in prof["rows"]:
        if r["config"] == config and r["peer"] == peer and bool(r["options"]["compile"]) == fast:
            return r
    return None


def _ms(row: dict, kind: str) -> float:
    return row["share"][kind] * row["wall_ms_per_step"]


def _compile_s(row: dict) -> str:
    return f"{row['compile_s']:.0f} s" if row.get("compile_s") is not None else "? s"


def _precision_finding(ts: dict) -> str:
    """The first finding: the measured bf16/fp32 GEMM ratio, what gives it, and the fast path's precision."""
    peaks, flags = ts["peak_flops"], ts["machine"]["flags"]
    ratio = peaks["bf16"] / peaks["fp32"]
    head = f"This CPU's bf16 GEMM peak is {common.times(ratio)} its fp32 peak"
    rates = f"{common.gflops(peaks['bf16'])} vs {common.gflops(peaks['fp32'])} GFLOP/s"
    hardware = "AMX tiles" if common.has_amx(flags) else common.bf16_support(flags)
    precision = train_step.fast_precision(ts)
    if precision == "bf16" and ratio >= 1:
        return (
            f"{head} ({hardware}); LayerNorm, GELU, residual adds, dtype casts, attention and the optimizer get no "
            "such speed-up, so bf16 MFU is bounded by how much of the step is not GEMM."
        )
    if precision == "bf16":
        return f"{head} ({rates}; {hardware}), yet the fast path runs in bf16 here: --fast-precision bf16 forced it."
    if ratio >= 1:
        return (
            f"{head} ({hardware}), yet the fast path runs in fp32 here: --fast-precision fp32 forced it, and the "
            "bf16-only row is skipped."
        )
    support = common.bf16_support(flags)
    why = (
        f"bf16 has no hardware support here ({support})"
        if support == "no bf16 instructions"
        else f"bf16 is slower than fp32 here despite {support}"
    )
    return (
        f"{head} ({rates}): {why}, so the fast path runs in fp32 (torch.compile + fused AdamW, every library "
        "alike) and the bf16-only row is skipped."
    )


def _heap_finding(hp: dict) -> str | None:
    """The held heap's sentence: faults, system time and step time, held against glibc's default."""
    rows = {r["hold_heap"]: r for r in hp["rows"]}
    off, on = rows.get(False), rows.get(True)
    if not off or not on or not on["held"]:
        return None
    return (
        f"train.hold_heap (on by default for un-checkpointed CPU runs): a {hp['label']} step faulted "
        f"{off['minflt']:,.0f} pages in and spent {off['sys_s']:.3f} s in the kernel with glibc's default, "
        f"{on['minflt']:,.0f} and {on['sys_s']:.3f} s held; step time {off['wall_s']:.3f} vs {on['wall_s']:.3f} s "
        f"(medians of each setting's processes); default / held step time {hp['speedup']:.3f} (median over "
        f"{hp['pairs']} pairs of processes)."
    )


def findings(ts: dict, prof: dict, mem: dict, hp: dict | None = None) -> list[str]:
    """What the measurements say, as sentences whose numbers come from this run (``hp``: benchmarks.heap's)."""
    out = [_precision_finding(ts)]
    words = train_step.fast_path_words(train_step.fast_precision(ts))
    for _key, res in ts["configs"].items():
        label = res["label"]
        eager = _variant(res, "kilolayer")
        fused = _variant(res, "kilolayer fp32 + fused AdamW")
        bf16 = _variant(res, "kilolayer bf16 + fused AdamW")
        nobias = _variant(res, "kilolayer, bias=False")
        modes = {v["options"]["compile"]: v for v in _kilolayer_fast(res)}
        if eager and fused and nobias and modes and "ratio_vs_faster_peer" in eager:
            autocast = f"+ bf16 autocast {bf16['ratio_vs_faster_peer']:.2f}x; " if bf16 else ""
            compiled = "; ".join(
                f"+ {common.COMPILE_LABELS[m]} {v['ratio_vs_faster_peer']:.2f}x ({_pct(v['mfu'])} of the "
                f"{v['options']['precision']} peak)"
                for m, v in modes.items()
            )
            out.append(
                f"{label}: kilolayer eager fp32 runs at {eager['ratio_vs_faster_peer']:.2f}x {res['faster_peer']} "
                f"({nobias['ratio_vs_faster_peer']:.2f}x without biases); + fused AdamW "
                f"{fused['ratio_vs_faster_peer']:.2f}x; {autocast}{compiled} (all against {res['faster_peer']}'s "
                "eager fp32)."
            )
        peer_fast = _variant(res, res["best_peer_fast"]) if res.get("best_peer_fast") else None
        if modes and peer_fast:
            best = next(iter(modes.values()))  # the fastest mode
            each = ", ".join(
                f"{m} {v['ratio_vs_best_peer_fast']:.2f}x after {_compile_s(v)} of compile" for m, v in modes.items()
            )
            m = _rematch(res)
            again = (
                f" Timed again, {m['rounds']} rounds with no other row stepping: {m['ratio']:.2f}x {m['peer']} "
                f"({common.interval_words(m)})."
                if m
                else ""
            )
            out.append(
                f"{label}, every library on the same fast path ({words}): "
                f"kilolayer's better compile mode is {_mode(best)}, at {best['ratio_vs_best_peer_fast']:.2f}x the "
                f"best peer, {peer_fast['name']} ({_compile_s(peer_fast)} of compile); by mode: {each}.{again}"
            )
        k, x = _profile_row(prof, label, "kilolayer", False), _profile_row(prof, label, res["faster_peer"], False)
        f = _profile_row(prof, label, "kilolayer", True)
        if k and x:
            ms = _ms
            out.append(
                f"{label} profile (1 thread), eager fp32: kilolayer {k['wall_ms_per_step']:.0f} ms/step, of which "
                f"matmul {ms(k, 'matmul'):.0f}, elementwise/norm/copy {ms(k, 'elementwise/norm/copy'):.0f}, "
                f"attention {ms(k, 'attention'):.0f}, optimizer {ms(k, 'optimizer'):.0f}, host "
                f"{ms(k, 'host overhead'):.0f}; {res['faster_peer']} {x['wall_ms_per_step']:.0f} ms/step: matmul "
                f"{ms(x, 'matmul'):.0f}, elementwise {ms(x, 'elementwise/norm/copy'):.0f}, attention "
                f"{ms(x, 'attention'):.0f}, optimizer {ms(x, 'optimizer'):.0f}, host {ms(x, 'host overhead'):.0f}."
            )
        if f:
            out.append(
                f"{label} profile, fast path ({f['options']['precision']}): matmul {_pct(f['share']['matmul'])} "
                f"(attention's products among them, model.cpu_attention: auto), SDPA kernels "
                f"{_pct(f['share']['attention'])}, inductor's fused elementwise kernels "
                f"{_pct(f['share']['compiled kernels'])}, other elementwise {_pct(f['share']['elementwise/norm/copy'])}"
                f", optimizer {_pct(f['share']['optimizer'])}, host {_pct(f['share']['host overhead'])}."
            )
    la = ts["loss_agreement"]
    each = "; ".join(
        f"compile: {mode} {m['final_loss']:.4f} (relative difference {100 * m['final_rel_diff']:.2f}%, largest gap "
        f"along the way {m['max_abs_diff']:.4f})"
        for mode, m in la["modes"].items()
    )
    la_words = train_step.fast_path_words(la.get("precision", "bf16"))
    out.append(
        f"Fast path ({la_words}) vs eager fp32 after {la['steps']} steps from the same seed on the same batches: "
        f"fp32 loss {la['final_loss_fp32']:.4f}; fast path with {each}."
    )
    ck = [r for r in mem["rows"] if r["peer"] == "kilolayer" and r["checkpoint"] and "peak_gib" in r]
    if ck:
        d = max(ck, key=lambda r: r["layers"])
        before, before_s = d.get("peak_gib_untrimmed"), d.get("step_s_untrimmed")
        pinned, pinned_s = d.get("peak_gib_pinned"), d.get("step_s_pinned")
        out.append(
            f"{d['label']} checkpointed: peak {d['peak_gib']:.2f} GiB at {d['step_s']:.1f} s a step, of which "
            f"{d['weights_and_adam_gib']:.2f} GiB weights, gradients and AdamW state and {d['baseline_gib']:.2f} GiB "
            "the interpreter and libraries"
            + (
                f"; before the heap trim (train.trim_heap_every: 0) {before:.2f} GiB at {before_s:.1f} s (the "
                "difference is allocator fragmentation)"
                if before and before_s
                else ""
            )
            + (f"; with train.pin_mmap {pinned:.2f} GiB at {pinned_s:.1f} s" if pinned and pinned_s else "")
            + "."
        )
    said = _heap_finding(hp) if hp else None
    if said:
        out.append(said)
    return out


def _precision_lines(ts: dict) -> list[str]:
    """The Machine section's peaks and the fast path's precision, with why."""
    peaks, choice = ts["peak_flops"], train_step.fast_choice(ts)
    return [
        f"- Peak GEMM measured in the speed run: fp32 {common.gflops(peaks['fp32'])} GFLOP/s, bf16 "
        f"{common.gflops(peaks['bf16'])} GFLOP/s ({common.times(peaks['bf16'] / peaks['fp32'])} fp32's)",
        f"- Fast path: {train_step.fast_path_words(choice['precision'])}; precision {choice['precision']}, chosen "
        f"from the peaks measured before the race ({choice['reason']})",
    ]


def _fast_rows_text(ts: dict) -> list[str]:
    """The paragraph on the fast-path rows' switches, for the precision they ran in."""
    choice = train_step.fast_choice(ts)
    if choice["precision"] == "bf16":
        precision = [
            "Fast-path rows: `bf16` = CPU autocast to bfloat16 with fp32 weights and optimizer state",
            "(`train.precision: bf16`);",
        ]
    else:
        precision = [
            "Fast-path rows run in fp32 in this run (`train.precision: fp32`; see Machine and versions for why),",
            "and the row whose only point is bf16 (`kilolayer bf16 + fused AdamW`) is skipped with the reason in",
            "its note;",
        ]
    return precision + [
        "`per-layer compile` = `torch.compile` on each layer (`train.compile: layers`;",
        "x-transformers' layer list holds lists of modules, so it gets only the whole-model row);",
        "`whole-model compile` = `torch.compile` of embeddings, layers and LM head once (`train.compile: model`);",
        "`fused AdamW` = `torch.optim.AdamW(fused=True)` (`train.fused_optimizer`). `compile s` is the first",
        "step's extra time.",
    ]


def _heap_section(hp: dict | None) -> list[str]:
    if not hp:
        return []
    return [
        "## Page faults between steps (`train.hold_heap`)",
        "",
        heap.format_result(hp),
        "",
        "glibc hands the top of its heap back to the system once a step has freed its activations, and its",
        "dynamic mmap threshold gives larger blocks their own mappings; the next step then faults the same",
        "pages in again, each zeroed by the kernel. The trainer's `train.hold_heap` (on by default on the CPU",
        "when no layer is checkpointed; `kilolayer.train.host.heap.hold_heap`) fixes glibc's mmap threshold",
        "at 32 MiB and its trim threshold at 2 GiB, so each step reuses the last one's pages. Each row's",
        "processes ran the same steps on the same data; the race above runs with glibc's defaults for every",
        "library.",
        "",
    ]


def _side_by_side_section(sb: dict | None) -> list[str]:
    if not sb:
        return []
    m = sb["machine"]
    load = sb.get("load")
    return [
        "## Runs side by side (the thread policy)",
        "",
        f"Measured {m['date']} on {m['cpu']}, {m['cores']} cores (flags: {', '.join(m['flags']) or 'none listed'})"
        + (f"; load average (1/5/15 min) before: {load}" if load else "")
        + ".",
        "",
        side_by_side.format_result(sb),
        "",
        f"Each cell is the wall time of `kilolayer train` ({sb['steps']} steps of a reversal task, start-up",
        "included): alone, then two started together (the mean of the two)"
        + (
            f"; each setting was measured {sb['repeats']} times, settings taking turns, and a cell is the median"
            " with the range of the runs (the ratio: the median over the repeats of each pair's time over the run"
            " alone of its own repeat)"
            if sb.get("repeats", 1) > 1
            else ""
        )
        + ". `auto` (`--threads auto`) takes the",
        "usable CPUs less those other work keeps busy, at most an even share among the `auto` runs training beside",
        "it, and checks again after its first step and then about every second, so its losses are not",
        "bit-reproducible; `every core` gives each process every usable CPU, the default count (fixed for the",
        "run), and two such processes' spinning threads fight over the cores. `study --jobs 2` is `kilolayer",
        "study` of the same run: one point at `--jobs 1` alone, then two seeds at `--jobs 2`, each point training",
        "on its share of the CPUs (one thread here), the pair's time the whole study's; both sides of its ratio",
        "include the study's own start-up and report, so it is not comparable with the `kilolayer train` rows'",
        "times. Two runs sharing the cores",
        "can be no faster than one run on half of them: a model whose step gains from a second thread has a",
        "side-by-side ratio bounded below by its own one-thread / every-core time.",
        "",
    ]


def _attention_section(att: dict | None) -> list[str]:
    """How ``model.cpu_attention``'s three ways compare, with the machine and date they were measured on."""
    if not att:
        return []
    own = att["machine"]
    where = f" Measured on {own['cpu']}, {own['date']}."
    return [
        "## Attention on a CPU under bf16",
        "",
        "What `model.cpu_attention: auto` chooses between (`python -m benchmarks.attention`): the three ways attend",
        "the same bf16 Q, K and V in turn, forward and backward; `products` is kilolayer's `matmul_attention`",
        f"(two bf16 matrix products around an fp32 softmax).{where}",
        "",
        attention.format_result(att),
        "",
    ]


def _study_points_section(sp: dict | None) -> list[str]:
    """Where the built-in CPU studies' points gain from bf16 and compile, with the machine and date measured."""
    if not sp:
        return []
    return [
        "## The built-in studies' points: bf16 and compile",
        "",
        "What a study's points would gain from bf16 autocast and from `train.compile: layers` within their step",
        "caps (`python -m benchmarks.study_points`): each point's config as its study trains it, four runs of it",
        "(eager fp32, eager bf16, and each compiled), one thread, one run at a time, every compile from an empty",
        "cache. `step ms` is the steady step; `fixed s` the rest of the run (set-up, the first steps, compiling,",
        "one evaluation); `x eager fp32 at the cap` the point's time at its step cap against eager fp32's (above 1:",
        "faster). `auto here` is what `train.precision: auto` decides for the point's step on this machine, with",
        "the ratio its probe measured ([speed.md](speed.md#precision-auto)); a study decides once for all of its",
        "points, bf16 only where every one of its steps pays.",
        "",
        study_points.format_result(sp),
        "",
    ]


def markdown(
    ts: dict,
    mem: dict,
    prof: dict,
    commands: list[str],
    seconds: float,
    hp: dict | None = None,
    sb: dict | None = None,
    att: dict | None = None,
    sp: dict | None = None,
) -> str:
    m = ts["machine"]
    v = m["versions"]
    lines = [
        "# Benchmarks: kilolayer side by side with torchscale and x-transformers",
        "",
        "Generated by `python -m benchmarks.run_all --out docs/benchmarks.md`; every number below was measured by",
        "the scripts in `benchmarks/` in that one run, except a section that states its own machine and date",
        "(re-measured alone: `--from-json docs/benchmarks.json --replace SECTION=FILE`). Timings on a shared machine",
        "drift: only the side-by-side ratios (the implementations take turns, one step each per round) are meant to",
        "be compared.",
        "",
        "## Machine and versions",
        "",
        f"- Date: {m['date']}; total time {seconds / 60:.1f} min",
        f"- CPU: {m['cpu']}, {m['cores']} cores visible, torch threads {m['torch_threads']}; "
        f"flags: {', '.join(m['flags']) or 'n/a'}",
        *_precision_lines(ts),
        f"- Load average (1/5/15 min) before / after the speed run: {ts['load_before']} / {ts['load_after']}; "
        f"memory run: {mem['load_before']} / {mem['load_after']}",
        f"- Python {m['python']}, torch {v['torch']}, kilolayer {v['kilolayer']}, torchscale {v['torchscale']}, "
        f"x-transformers {v['x-transformers']}, fairscale {v['fairscale']}",
        "",
        "Commands:",
        "",
        "```",
        *commands,
        "```",
        "",
        "## Targets",
        "",
        common.table(targets(ts, mem, sb), [("target", "target"), ("measured", "measured"), ("met", "met")]),
        "",
        "## What the measurements say",
        "",
        *[f"- {line}" for line in findings(ts, prof, mem, hp)],
        "",
        "## Training-step throughput and MFU",
        "",
        "A step: forward, LM head (bias-free Linear to the vocabulary), cross-entropy on random tokens, backward,",
        "AdamW. All three libraries build the same decoder-only DeepNorm model: same width, depth, heads, FFN,",
        "vocabulary and sequence length, Post-LN with the shortcut scaled by alpha (torchscale `deepnorm=True`;",
        "x-transformers `pre_norm=False, scale_residual_constant=alpha`). The peers' plain rows run eager fp32",
        "with the same AdamW as the `kilolayer` row (its multi-tensor path, the trainer's default); their",
        "fast-path rows run under the same switches as kilolayer's. x-transformers' attention projections have",
        "no biases (it offers none); kilolayer and torchscale have them, and the `kilolayer, bias=False` row",
        "drops all of kilolayer's.",
        "`x faster peer` is the median over rounds of (faster peer's eager fp32 step time / this step time), so",
        "it can differ from the ratio of the tokens/s medians when rounds vary; `x best peer fast path` is the",
        "same against the fastest peer fast-path row. MFU = tokens/s x model FLOPs per token",
        "(`kilolayer.training_flops` per sample / tokens + 6 d V for the head) / the best large-GEMM rate of the",
        "precision the row's matmuls run in (fp32 or bf16), measured in this run.",
        *_rematch_text(ts),
        *_fast_rows_text(ts),
        "",
        train_step.format_result(ts),
        "",
        "## Where the time goes (torch.profiler)",
        "",
        "Profiled in the same run with one torch thread (shares of the profiled wall time, so they do not depend",
        "on other load; `host overhead` is time inside no op: Python, dispatch, autograd bookkeeping). The",
        "faster peer is profiled too, to show where kilolayer's eager step differs from it.",
        "",
        profile_step.format_result(prof),
        "",
        *_attention_section(att),
        "## Peak memory vs depth",
        "",
        memory.format_result(mem),
        "",
        "`above imports` subtracts the process's size after importing torch and the library. `weights+grads+AdamW`",
        "is 16 bytes per parameter (fp32 weight, gradient and two moments): the floor any fp32 AdamW step needs.",
        "With layers checkpointed, kilolayer hands the heap's free pages back to the system every 32 layers,",
        "forward and backward (`train.trim_heap_every`, on by default; `kilolayer.train.host.heap.HeapTrimmer`).",
        "Each recomputed layer frees its activation blocks between tensors that live on, and without the trim",
        "those holes stay resident: the `trim_heap_every 0 (before)` columns rerun kilolayer's deepest",
        "checkpointed points with it off (`KILOLAYER_TRIM_HEAP=0`), and the difference in peak is allocator",
        "fragmentation, not tensors the step keeps. `train.pin_mmap` (opt-in) pins glibc's mmap threshold at",
        "64 KiB instead, so every such block is a fresh mapping; its columns rerun the same points with it on",
        "(`KILOLAYER_PIN_MMAP=1`). The peers' rows run with glibc's defaults: they have no such trim.",
        "",
        *_heap_section(hp),
        *_side_by_side_section(sb),
        *_study_points_section(sp),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="FILE", default="docs/benchmarks.md", help="the Markdown file to write")
    parser.add_argument("--json", metavar="FILE", help="raw results (default: --out with .json)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and 1-2 repetitions")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the speed runs (default 1: on a shared machine a second OpenMP thread stalls "
        "whenever another process holds a core, which skews ratios; use 2 on an idle 2-core machine)",
    )
    common.add_fast_precision_arg(parser)
    parser.add_argument("--rounds", type=int, help="timed rounds per speed config (default 6)")
    parser.add_argument(
        "--from-json",
        metavar="FILE",
        help="write --out again from the results of an earlier run (its .json) without measuring anything",
    )
    parser.add_argument(
        "--replace",
        action="append",
        default=[],
        metavar="SECTION=FILE",
        help="with --from-json: one section's results (side_by_side, heap, memory, ...) from its own script's "
        "--out FILE, written into the .json too; the section states its own machine and date",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        for item in args.replace:
            name, _, path = item.partition("=")
            res[name] = json.loads(Path(path).read_text())
        if args.replace:
            common.write_json(Path(args.from_json), res)
        ts, prof, mem, hp, sb, att, sp = (
            res.get(k) for k in ("train_step", "profile", "memory", "heap", "side_by_side", "attention", "study_points")
        )
        Path(args.out).write_text(markdown(ts, mem, prof, res["commands"], res["seconds"], hp, sb, att, sp))
        print(f"wrote {args.out} from {args.from_json}")
        return 0
    common.apply_threads(args.threads)
    t0 = time.perf_counter()
    ts = train_step.run(smoke=args.smoke, rounds=args.rounds, fast_precision=args.fast_precision)
    print(train_step.format_result(ts), flush=True)
    # one thread: shares that do not depend on the machine's load; the fast path as the speed run chose it
    prof = profile_step.run(smoke=args.smoke, threads=1, choice=ts["fast_precision"])
    print(profile_step.format_result(prof), flush=True)
    att = attention.run(smoke=args.smoke, threads=args.threads)
    print(attention.format_result(att), flush=True)
    mem = memory.run(smoke=args.smoke)
    print(memory.format_result(mem), flush=True)
    hp = heap.run(smoke=args.smoke)
    print(heap.format_result(hp), flush=True)
    sb = side_by_side.run(smoke=args.smoke)
    print(side_by_side.format_result(sb), flush=True)
    sp = study_points.run(smoke=args.smoke)
    print(study_points.format_result(sp), flush=True)
    seconds = time.perf_counter() - t0
    smoke = " --smoke" if args.smoke else ""
    extra = f"{smoke} --threads {args.threads}"
    fast = f" --fast-precision {args.fast_precision}" if args.fast_precision != "auto" else ""
    commands = [
        f"python -m benchmarks.run_all --out {args.out}{extra}{fast}"
        + (f" --rounds {args.rounds}" if args.rounds else ""),
        "# or one at a time:",
        f"python -m benchmarks.train_step{extra}{fast} --out train_step.json",
        f"python -m benchmarks.profile_step{smoke} --threads 1 --fast-precision {ts['fast_precision']['precision']} "
        "--out profile.json",
        f"python -m benchmarks.attention{extra} --out attention.json",
        f"python -m benchmarks.memory{extra} --out memory.json",
        f"python -m benchmarks.heap{smoke} --out heap.json",
        f"python -m benchmarks.side_by_side{smoke} --out side_by_side.json",
        f"python -m benchmarks.study_points{smoke} --out study_points.json",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(ts, mem, prof, commands, seconds, hp, sb, att, sp))
    json_path = Path(args.json) if args.json else out.with_suffix(".json")
    common.write_json(
        json_path,
        {
            "train_step": ts,
            "profile": prof,
            "memory": mem,
            "heap": hp,
            "side_by_side": sb,
            "attention": att,
            "study_points": sp,
            "seconds": seconds,
            "commands": commands,
        },
    )
    print(f"wrote {out} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
