"""Verdicts: the rule, the registered measures and contrasts, and claims written as data.

A claim (:class:`Claim`) names the runs it reads (a group of its study spec), a measure (:data:`MEASURES`), a
contrast (:data:`CONTRASTS`), a margin with its reason and its requirements; :func:`judge` turns a study's runs
into a :class:`Finding` by the one rule (:data:`RULE`). Python is needed only to add a measure or a contrast kind.
"""

from kilolayer.verdicts.claims import REQUIREMENTS, Claim, check_claim, judge, parse_claim, rule_text
from kilolayer.verdicts.contrasts import CONTRASTS, Contrast, register_contrast
from kilolayer.verdicts.measures import MEASURES, Measure, register_measure
from kilolayer.verdicts.rule import HELD, INCONCLUSIVE, NOT_HELD, RULE, Finding, Verdict, decide, sign_test_p

__all__ = [
    "CONTRASTS",
    "Claim",
    "Contrast",
    "Finding",
    "HELD",
    "INCONCLUSIVE",
    "MEASURES",
    "Measure",
    "NOT_HELD",
    "REQUIREMENTS",
    "RULE",
    "Verdict",
    "check_claim",
    "decide",
    "judge",
    "parse_claim",
    "register_contrast",
    "register_measure",
    "rule_text",
    "sign_test_p",
]
