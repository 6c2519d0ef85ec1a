"""The study report: report.md and a self-contained report.html (PNGs embedded).

Spec names, descriptions, grid and config values, run reasons and finding text
are the user's, so neither file lets them become markup: in report.md every
``<`` of such text is written ``&lt;`` (shown as ``<`` by any Markdown viewer),
and report.html is rendered with raw HTML disabled, links only to http(s) or
mailto, and images only as PNG files inside the study's own directory, embedded
as data URIs (any other image becomes a note). A Content-Security-Policy that
allows no script and no remote fetch backs this up.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import os
import platform
import re
from pathlib import Path
from urllib.parse import urlsplit

from kilolayer.rundir import RunDir
from kilolayer.study import clock
from kilolayer.study.claim_plots import claim_plots
from kilolayer.study.directions_report import directions_section
from kilolayer.study.findings import evaluate_findings
from kilolayer.study.registered import post_hoc
from kilolayer.verdicts.claims import judge
from kilolayer.verdicts.rule import HELD, INCONCLUSIVE, NOT_HELD, RULE, Finding

# plain words (emoji need a font the reader may not have); the HTML colours them
BADGE = {HELD: "held", NOT_HELD: "did not hold", INCONCLUSIVE: "inconclusive"}
VERDICT_CLASS = {HELD: "held", NOT_HELD: "not-held", INCONCLUSIVE: "inconclusive"}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}"


def versions() -> str:
    import torch

    import kilolayer

    return f"kilolayer {kilolayer.__version__}, torch {torch.__version__}, Python {platform.python_version()}"


def _text(value) -> str:
    """Text for report.md that no Markdown renderer turns into HTML: ``<`` becomes the entity ``&lt;``."""
    return str(value).replace("<", "&lt;")


def _cell(value) -> str:
    return " ".join(_text(value).replace("|", "/").splitlines())


def _table(headers, rows) -> str:
    if not rows:
        return "_no rows_\n"
    out = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(_cell(c) for c in r) + " |")
    return "\n".join(out) + "\n"


def _fenced(lines: list[str]) -> list[str]:
    """A code block whose fence is longer than any run of backticks inside it, so no line can close it."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, *lines, fence]


def precision_line(results) -> str:
    """The precisions the runs trained at, with why, in one line (runs that recorded none are left out)."""
    counts: dict[tuple[str, str], int] = {}
    for r in results:
        if r.precision:
            counts[r.precision, r.precision_reason] = counts.get((r.precision, r.precision_reason), 0) + 1
    return "; ".join(
        f"{value} for {n} run{'s' * (n != 1)}" + (f" ({why})" if why else "") for (value, why), n in counts.items()
    )


def render_markdown(spec, results, findings: list[Finding], out: Path, wall_seconds: float) -> str:
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    train_s = sum(r.seconds for r in results)
    tokens = 0
    for r in results:
        try:
            tokens += int(RunDir(r.point.run_dir(out)).status.get("tokens", 0))
        except (TypeError, ValueError):
            pass
    seeds = sorted({r.point.config.train.seed for r in results})
    precisions = precision_line(results)
    lines = [
        f"# kilolayer study: {_text(spec.name)}",
        "",
        _text(spec.description.strip()),
        "",
        f"- **date**: {now}",
        f"- **machine**: {machine()}",
        f"- **versions**: {versions()}",
        f"- **runs**: {len(results)} ({sum(r.ran for r in results)} trained in this invocation, the rest reused); "
        f"seeds {seeds}",
        f"- **compute**: {train_s / 60:.1f} min of training time in total, {tokens:,} tokens processed; "
        f"{clock.wall_line(out, wall_seconds)}",
        *([f"- **precision**: {_text(precisions)}"] if precisions else []),
        "",
        "## Verdicts",
        "",
        "Each verdict comes from the measured numbers by one rule, the same for every claim. "
        + RULE
        + " A claim measured on several modalities or pairs gets one verdict each; they are never pooled. "
        "Each claim's deciding fields, and the budget, seeds, grid and settings of the runs it reads, are recorded "
        "in claims.json before those runs train; a claim first recorded, or changed, after some of its runs had "
        "finished is labelled *post hoc*, with what changed.",
        "",
        _table(
            ["claim", "verdict", "measured", "still improving at the budget"],
            [
                [f.title + (" (post hoc)" if f.post_hoc else ""), f"**{BADGE[f.verdict.verdict]}**", f.verdict.reason]
                + [f.improving or "-"]
                for f in findings
            ],
        ),
    ]
    left_out = getattr(spec, "claims_left_out", [])
    if left_out:
        lines += [
            "**Claims left out.** Of the sets of claims the spec names, these read groups it does not have, so they "
            "have no verdict here:",
            "",
            *[f"- {_text(line)}" for line in left_out],
            "",
        ]
    for f in findings:
        lines += [
            f"## {_text(f.title)}",
            "",
            f"**Claim.** {_text(f.claim)}  ",
            f"**Reference.** {_text(f.reference)}",
            "",
            f"**Rule.** {_text(f.rule)}",
            "",
            *[f"- {_text(note)}" for note in f.notes],
            *([""] if f.notes else []),
            _table(f.headers, f.rows),
        ]
        for path, caption in f.plots:
            rel = os.path.relpath(path, out)
            lines += [f"![{_text(caption)}]({rel})", "", f"*{_text(caption)}*", ""]
        lines += [f"**Verdict: {BADGE[f.verdict.verdict]}.** {_text(f.verdict.reason)}.", ""]
        if f.post_hoc:
            lines += [f"**Post hoc.** This claim was {_text(f.post_hoc)}.", ""]
        if f.improving:
            lines += [f"**Still improving.** {_text(f.improving)}.", ""]
        if f.scale_up:
            lines += [f"**To test this claim properly:** {_text(f.scale_up)}", ""]
    lines += ["## Runs", "", "Every grid point is an ordinary `kilolayer train` run directory under `runs/`.", ""]
    lines += [
        "*ended*: a completed run either used its step budget or stopped early on a validation plateau "
        "(`train.patience`); *MFU*: model FLOPs per second over the device's peak, the run's mean; *precision*: "
        "what its steps ran at (`train.precision`, `auto` decided at the run's start).",
        "",
    ]
    rows = []
    for r in results:
        ev = ", ".join(f"{k} {v:.4g}" for k, v in r.eval.items() if k not in ("step", "split") and isinstance(v, float))
        status = r.status + (f" at step {r.step}: {r.reason}" if r.status != "completed" else "")
        st = RunDir(r.point.run_dir(out)).status
        ended = "-"
        if r.status == "completed":
            ended = f"plateau (best step {st.get('best_step')})" if st.get("stopped_early") else "step budget"
        mfu = st.get("mfu")
        rows.append(
            [
                r.point.key,
                status,
                ended,
                ev or "-",
                f"{mfu:.1%}" if isinstance(mfu, (int, float)) else "-",
                r.precision or "-",
                f"{r.seconds:.0f}",
            ]
        )
    lines.append(_table(["point", "status", "ended", "last evaluation", "MFU", "precision", "seconds"], rows))
    lines += directions_section(results, out, _table)
    diagnosed = diagnoses(results, out)
    if diagnosed:
        lines += [
            "## Why points failed or diverged",
            "",
            "The diagnosis `kilolayer doctor RUN_DIR` gives for each failed or diverged point, in one paragraph: "
            "each problem its rules found, with the measurement behind it and the fix it suggests (the rules "
            "and thresholds: docs/doctor.md). That command prints every measurement; `--json` gives them as data.",
            "",
        ]
        for r in results:
            if r.point.key in diagnosed:
                lines += [
                    f"- **{_text(r.point.key)}** ({_text(r.status)} at step {r.step}): {_text(diagnosed[r.point.key])}",
                    "",
                ]
    lines += [
        "## Commands",
        "",
        "One line per point, in order (a group with `after` needs its source group finished): each reruns "
        "or resumes that point by hand, or can be sent to a cluster (write `torchrun --nproc-per-node N -m kilolayer` "
        "in place of `kilolayer` for N processes per point).",
        "",
    ]
    lines += _fenced([r.command for r in results])
    return "\n".join(lines) + "\n"


DIAGNOSED = ("failed", "diverged")  # the points whose doctor's diagnosis the report shows
REPLAY_MAX_LAYERS = 64  # deeper points are diagnosed from what they logged (replaying them takes minutes)


def diagnoses(results, out: Path) -> dict[str, str]:
    """The doctor's one-paragraph diagnosis (:func:`kilolayer.doctor.diagnose`) of each failed or diverged
    point, by point key. Step 1 is replayed and the newest checkpoint measured for points of at most
    ``REPLAY_MAX_LAYERS`` layers; deeper ones are diagnosed from their status, metrics.jsonl (logged
    diagnostics and losses) and cached analyses, and the paragraph says so. Nothing is written into the
    run directories, and a run the doctor cannot read is one sentence, never the end of the report."""
    from kilolayer.doctor import diagnose
    from kilolayer.errors import KilolayerError

    found = {}
    for r in results:
        if r.status not in DIAGNOSED:
            continue
        run = r.point.run_dir(out)
        m = r.point.config.model
        layers = (m.encoder_depth or 0) + (m.decoder_depth or 0)
        replay = layers <= REPLAY_MAX_LAYERS
        try:
            text = diagnose(run, replay_steps=1 if replay else 0, smoothness_samples=0).paragraph
            if not replay:
                text += (
                    f" (From what the run logged only: at {layers} layers, replaying its first step is left to "
                    f"`kilolayer doctor {run}`.)"
                )
        except KilolayerError as err:
            text = f"The doctor cannot diagnose this run: {' '.join(str(err).split())}"
        except Exception as err:  # one point's diagnosis must not cost the report of the others
            text = f"The doctor failed on this run ({type(err).__name__}: {' '.join(str(err).split())[:300]})"
        found[r.point.key] = text
    return found


CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;line-height:1.45;color:#222}table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;overflow-wrap:anywhere}
td:first-child{min-width:12em}td strong{white-space:nowrap}th{background:#f3f3f3}img{max-width:100%;
border:1px solid #eee}code{background:#f6f6f6;padding:1px 3px;font-size:0.85em}
pre{background:#f6f6f6;padding:0.6em;overflow-x:auto;font-size:0.8em}.held{color:#176b1d}.not-held{color:#b3261e}
.inconclusive{color:#8a6d00}.skipped{color:#666}"""


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LINK_SCHEMES = ("http", "https", "mailto")
# no script at all, nothing fetched: images are data URIs, styles the inline sheet
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"


def embeddable_image(src: str, out: Path) -> Path | None:
    """The PNG file that ``src`` names if it lies inside the study directory ``out``, else None.

    ``src`` must be a relative path (no scheme, not absolute) that still lies inside ``out`` once resolved
    (``..`` and symbolic links followed), and the file must be a PNG.
    """
    if not src or ":" in src or src.startswith(("/", "\\")) or Path(src).is_absolute():
        return None
    root = Path(out).resolve()
    path = (root / src).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    try:
        with open(path, "rb") as fh:
            return path if fh.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE else None
    except OSError:
        return None


def _safe_link(href: str) -> bool:
    # browsers ignore control characters and spaces inside a scheme ("java\tscript:")
    # and decode entities first ("javascript&#58;..." is javascript: to a browser)
    cleaned = "".join(ch for ch in html.unescape(href) if ord(ch) > 32)
    return urlsplit(cleaned).scheme.lower() in LINK_SCHEMES + ("",)


def _tree_processor(out: Path):
    """A Markdown tree processor that embeds the study's own PNGs, neutralises every other image and any
    link outside http(s)/mailto, and colours the verdict words."""
    from xml.etree import ElementTree

    from markdown.treeprocessors import Treeprocessor

    verdict_words = {}
    for key, word in BADGE.items():
        verdict_words[word] = verdict_words[f"Verdict: {word}."] = VERDICT_CLASS[key]

    class SafeReport(Treeprocessor):
        def run(self, root):
            for parent in list(root.iter()):
                for index, el in enumerate(list(parent)):
                    if el.tag == "img":
                        src = el.get("src", "")
                        path = embeddable_image(src, out)
                        if path is not None:
                            data = base64.b64encode(path.read_bytes()).decode()
                            el.attrib = {"src": f"data:image/png;base64,{data}", "alt": el.get("alt", "")}
                        else:
                            note = ElementTree.Element("em", {"class": "skipped"})
                            note.text = f"[image not embedded: {src!r} is not a PNG inside the study directory]"
                            note.tail = el.tail
                            parent.remove(el)
                            parent.insert(index, note)
                    elif el.tag == "a" and not _safe_link(el.get("href", "")):
                        el.attrib.pop("href", None)
                    elif el.tag == "strong" and el.text in verdict_words and not len(el):
                        el.set("class", verdict_words[el.text])

    return SafeReport


def render_html(markdown_text: str, out: Path) -> str:
    """report.html from report.md's text: see the module docstring for what is escaped or refused."""
    import markdown

    md = markdown.Markdown(extensions=["tables", "fenced_code"])
    # raw HTML in the Markdown is text, not markup
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    # after the inline patterns (priority 20) have made the links and images, before serialisation
    md.treeprocessors.register(_tree_processor(Path(out))(md), "kilolayer_safe_report", 5)
    body = md.convert(markdown_text)
    title = html.escape(html.unescape(markdown_text.splitlines()[0].lstrip("# ")))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\"><title>{title}</title>"
        f"<style>{CSS}</style></head><body>{body}</body></html>\n"
    )


def write_report(spec, results, out: Path, wall_seconds: float) -> tuple[Path, Path, list[Finding]]:
    out = Path(out)
    (out / "report_files").mkdir(parents=True, exist_ok=True)
    groups = {g.name: g for g in spec.groups}
    findings = []
    for c in spec.claims:
        f = judge(c, results, groups, out)
        f.plots = claim_plots(c, results, out)
        f.post_hoc = post_hoc(c, [r.point for r in results], out)
        findings.append(f)
    findings += evaluate_findings(spec.findings, results, out)
    md = render_markdown(spec, results, findings, out, wall_seconds)
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(md)
    html_path.write_text(render_html(md, out))
    return md_path, html_path, findings
