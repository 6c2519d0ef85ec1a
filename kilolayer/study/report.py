"""The study report: report.md and a self-contained report.html (PNGs embedded)."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import os
import platform
import re
from pathlib import Path

from kilolayer.study.findings import FINDINGS, HELD, INCONCLUSIVE, NOT_HELD, Finding

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


def _table(headers, rows) -> str:
    if not rows:
        return "_no rows_\n"
    out = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |")
    return "\n".join(out) + "\n"


def render_markdown(spec, results, findings: list[Finding], out: Path, wall_seconds: float) -> str:
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    train_s = sum(r.seconds for r in results)
    tokens = 0
    for r in results:
        try:
            tokens += int(json.loads((r.point.run_dir(out) / "status.json").read_text()).get("tokens", 0))
        except (OSError, ValueError):
            pass
    seeds = sorted({r.point.config.train.seed for r in results})
    lines = [
        f"# kilolayer study: {spec.name}",
        "",
        spec.description.strip(),
        "",
        f"- **date**: {now}",
        f"- **machine**: {machine()}",
        f"- **versions**: {versions()}",
        f"- **runs**: {len(results)} ({sum(r.ran for r in results)} trained in this invocation, the rest reused); "
        f"seeds {seeds}",
        f"- **compute**: {train_s / 60:.1f} min of training time in total, {tokens:,} tokens processed; "
        f"this invocation took {wall_seconds / 60:.1f} min wall-clock",
        "",
        "## Verdicts",
        "",
        "Each verdict comes from the measured numbers by one rule: the claim becomes per-seed differences *d* "
        "that are positive when it holds; with *m* their mean and *se* their standard error, "
        "*t* = max(margin, 2·se); **held** if *m* > *t*, **did not hold** if *m* < −*t*, otherwise "
        "**inconclusive**. Nothing here was written in advance.",
        "",
        _table(["finding", "verdict", "measured"], [[f.title, f"**{BADGE[f.verdict.verdict]}**", f.verdict.reason]
                                                    for f in findings]),
    ]
    for f in findings:
        lines += [
            f"## {f.title}",
            "",
            f"**Claim.** {f.claim}  ",
            f"**Reference.** {f.reference}",
            "",
            f"**Rule.** {f.rule}",
            "",
            _table(f.headers, f.rows),
        ]
        for path, caption in f.plots:
            rel = os.path.relpath(path, out)
            lines += [f"![{caption}]({rel})", "", f"*{caption}*", ""]
        lines += [f"**Verdict: {BADGE[f.verdict.verdict]}.** {f.verdict.reason}.", ""]
        if f.scale_up:
            lines += [f"**To test this claim properly:** {f.scale_up}", ""]
    lines += ["## Runs", "", "Every grid point is an ordinary `kilolayer train` run directory under `runs/`.", ""]
    rows = []
    for r in results:
        ev = ", ".join(f"{k} {v:.4g}" for k, v in r.eval.items() if k not in ("step", "split") and isinstance(v, float))
        status = r.status + (f" at step {r.step}: {r.reason}" if r.status != "completed" else "")
        rows.append([r.point.key, status, ev or "-", f"{r.seconds:.0f}"])
    lines.append(_table(["point", "status", "last evaluation", "seconds"], rows))
    lines += ["## Commands", "",
              "One line per point, in order (a group with `after` needs its source group finished): each reruns "
              "or resumes that point by hand, or can be sent to a cluster (write `torchrun --nproc-per-node N -m kilolayer` "
              "in place of `kilolayer` for N processes per point).", "", "```"]
    lines += [r.command for r in results]
    lines += ["```"]
    return "\n".join(lines) + "\n"


CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;line-height:1.45;color:#222}table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}th{background:#f3f3f3}img{max-width:100%;
border:1px solid #eee}code{background:#f6f6f6;padding:1px 3px;font-size:0.85em}
pre{background:#f6f6f6;padding:0.6em;overflow-x:auto;font-size:0.8em}.held{color:#176b1d}.not-held{color:#b3261e}
.inconclusive{color:#8a6d00}"""


def render_html(markdown_text: str, out: Path) -> str:
    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables", "fenced_code"])

    def embed(m):
        src = m.group(1)
        p = (out / html.unescape(src)).resolve()
        if not p.is_file():
            return m.group(0)
        data = base64.b64encode(p.read_bytes()).decode()
        return f'src="data:image/png;base64,{data}"'

    body = re.sub(r'src="([^"]+\.png)"', embed, body)
    for key, word in BADGE.items():
        # the verdict words in the summary table and after each finding
        body = body.replace(f"<strong>{word}</strong>", f"<strong class='{VERDICT_CLASS[key]}'>{word}</strong>")
        body = body.replace(f"<strong>Verdict: {word}.</strong>",
                            f"<strong class='{VERDICT_CLASS[key]}'>Verdict: {word}.</strong>")
    title = markdown_text.splitlines()[0].lstrip("# ")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>\n")


def write_report(spec, results, out: Path, wall_seconds: float) -> tuple[Path, Path, list[Finding]]:
    out = Path(out)
    (out / "report_files").mkdir(parents=True, exist_ok=True)
    findings = [f for f in (FINDINGS[name](results, out) for name in spec.findings) if f is not None]
    md = render_markdown(spec, results, findings, out, wall_seconds)
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(md)
    html_path.write_text(render_html(md, out))
    return md_path, html_path, findings
