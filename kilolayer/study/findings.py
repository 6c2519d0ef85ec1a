"""Findings written in Python: for a question that no registered measure and contrast can state as a claim.

A claim is data (:mod:`kilolayer.verdicts.claims`, a spec's ``claims:``); every built-in one is. A finding is
``fn(results, out) -> Finding | list[Finding] | None`` registered here, named in a spec's ``findings:`` list, and
decided by the same rule (:func:`kilolayer.verdicts.rule.decide`). None means the study lacks the runs it reads; a
list gives one verdict per modality or pair, never pooled.
"""

from __future__ import annotations

from collections.abc import Callable

from kilolayer.registry import Registry
from kilolayer.verdicts.rule import Finding

FINDINGS: Registry[Callable] = Registry("study.findings", "finding", group="kilolayer.findings")


def register_finding(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn(results, out)`` under ``name``."""
    return FINDINGS.register(name)


def evaluate_findings(names, results, out) -> list[Finding]:
    """Every finding of ``names`` that the results support, lists flattened, in order."""
    found = []
    for name in names:
        f = FINDINGS.get(name)(results, out)
        found += f if isinstance(f, list) else [f] if f is not None else []
    for f in found:
        if not f.rows and f.verdict.per_seed:  # show the numbers the verdict was computed from
            f.headers, f.rows = ["seed", "d"], [[s, f"{d:+.4g}"] for s, d in sorted(f.verdict.per_seed.items())]
    return found
