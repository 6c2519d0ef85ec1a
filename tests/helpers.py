"""What several test modules need: the ``kilolayer`` command in a fresh interpreter, study results made up
for the verdict tests, and help pages in the format of the LibreOffice package the lo_help source reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``python -m kilolayer ARGS`` from the repository root, its output captured as text. It inherits
    OMP_NUM_THREADS=1 from tests/conftest.py, so its losses match an in-process run's bit for bit; ``kw`` goes
    to :func:`subprocess.run` (``env=`` replaces the environment)."""
    cmd = [sys.executable, "-m", "kilolayer", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, **kw)


# the chance levels made-up study results carry, so that no data is loaded to compute them
CHANCE = {"loss": 2.4, "accuracy": 0.1}


def study_results(study: str, outcome, seeds=(0, 1)) -> list:
    """Results for the points of the built-in ``study`` with ``seeds``, nothing trained: ``outcome(point)`` gives
    ``(status, final evaluation, diagnostics records)``; a completed run ends at its step budget with that
    evaluation, a diverged one at step 30. Chance levels are :data:`CHANCE`."""
    from kilolayer.study.runner import Result
    from kilolayer.study.spec import expand, load_spec

    results = []
    for p in expand(load_spec(study)):
        if p.values["train.seed"] not in seeds:
            continue
        status, final, diagnostics = outcome(p)
        step = p.config.train.steps if status == "completed" else 30
        r = Result(
            point=p,
            status=status,
            reason="" if status in ("completed", "diverged") else "boom",
            step=step,
            eval=dict(final),
            evals=[{"step": step, "split": "eval", **final}] if final else [],
            diagnostics=diagnostics,
        )
        r.chance = dict(CHANCE)
        results.append(r)
    return results


# ------------------------------------------------------------------ LibreOffice help pages (lo_help)

PAGE = """<!DOCTYPE html>
<html lang="en-US"><head><meta charset="utf-8"><title>t</title></head>
<body><div id="DisplayArea">
<h1 id="hd_id1">Example</h1>
{paragraphs}
</div></body></html>
"""
# module -> pages; each page's paragraphs are distinct sentences naming the module's application
FIXTURE = {"swriter": 10, "scalc": 10, "simpress": 5, "shared": 4}
REPEATED = "Press Enter to apply the change to the document."  # on two Writer pages: kept once
AMBIGUOUS = "Choose Tools - Options to change this setting."  # on a Calc page and a shared page: dropped
SHORT_HEADINGS = sum(FIXTURE.values())  # every page's "Example" heading is too short


def sentences(module: str, page: int) -> list[str]:
    from kilolayer.data import lo_help as L

    name = L.MODULES[module]
    return [f"{name} page {page} shows feature {k} of %PRODUCTNAME {name}." for k in range(3)]


def build_fixture(root: Path) -> None:
    """LibreOffice help pages in the package's format under ``root`` (what ``data.options.root`` of lo_help
    reads): :data:`FIXTURE` pages per module, with one repeated and one ambiguous text."""
    from kilolayer.data import lo_help as L

    for module, n in FIXTURE.items():
        for page in range(n):
            texts = sentences(module, page)
            if (module, page) in (("swriter", 1), ("swriter", 7)):
                texts.append(REPEATED)
            if (module, page) in (("scalc", 2), ("shared", 0)):
                texts.append(AMBIGUOUS)
            body = "\n".join(f'<p id="par_id{k}" class="paragraph">{t}</p>' for k, t in enumerate(texts))
            path = root / L.TEXT / module / "01" / f"{page:04d}.html"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(PAGE.format(paragraphs=body), encoding="utf-8")


def builtin_claim(name: str, study: str):
    """``finding(results, out)``: the built-in claim ``name`` judged on its groups of the built-in ``study``; a name
    of a set of claims gives the list of its claims' findings that the study's groups can decide."""
    from kilolayer.study.builtin import builtin_claim_sets, builtin_claims
    from kilolayer.study.spec import load_spec
    from kilolayer.verdicts.claims import judge, parse_claim

    def finding(results, out):
        groups = {g.name: g for g in load_spec(study).groups}
        sets = builtin_claim_sets()
        found = []
        for member in sets.get(name, [name]):
            claim = parse_claim(builtin_claims()[member], member)
            if all(g in groups for g in [*claim.groups(), *([claim.relative_to] if claim.relative_to else [])]):
                found.append(judge(claim, results, groups, out))
        return found if name in sets else found[0]

    return finding
