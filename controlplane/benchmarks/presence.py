"""Presence questions ("Is there a giraffe in the image?"), scored as POPE scores them.

Each answer is read as yes, no or unclear, and a set of answers is reported as accuracy,
precision, recall, F1 and the share answered yes, with "yes" the positive class. Pure
functions: no Django, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from controlplane import intervals

YES, NO, UNCLEAR = "yes", "no", "unclear"

# Contractions written out, with or without their apostrophe, so one pattern reads both.
_EXPANSIONS = [
    (r"\bcan'?t\b", "cannot"), (r"\bwon'?t\b", "will not"), (r"\b(\w+)n't\b", r"\1 not"),
    (r"\b(is|are|was|were|does|do|did|has|have|could|would|should)nt\b", r"\1 not"),
    (r"\bthere'?s\b", "there is"), (r"\bi'?m\b", "i am"), (r"\bit'?s\b", "it is"),
]
_UNSURE = re.compile(
    r"\b(not sure|unsure|unclear|cannot (tell|determine|say|be sure|be certain)|hard to (tell|say)"
    r"|difficult to (tell|say|determine)|i do not know|impossible to (tell|say|determine)|maybe|perhaps"
    r"|possibly|might be|may be)\b")
_YES_WORD = re.compile(r"^(yes|yeah|yep|yup|sure|certainly|indeed|correct|absolutely|affirmative|of course)\b")
_NO_WORD = re.compile(r"^(no|nope|nah|negative|not at all|not really)\b")
# Saying the object is absent, and saying it is there.
_DENIAL = re.compile(
    r"\b(there (is|are|was|were) (no|not|none|nothing)|(do|does|did|can|could) not (see|show|contain|have|"
    r"include|find|spot|detect|appear)|cannot (see|find|spot|detect)|see no|(is|are) not (visible|present|"
    r"shown|there|in (the|this) (image|picture|photo))|no \w+ (is|are|in|on|can)|none|nothing)\b")
_ASSERTION = re.compile(
    r"\b(there (is|are|was|were)|i (can )?see|(is|are) (visible|present|shown)|(shows|contains|features|"
    r"depicts|includes) (a|an|the|one|two|some|several|many|\d+))\b")
_NEGATION = re.compile(r"\b(no|not|none|nothing|never|neither|nor|cannot|without)\b")
_CLAUSES = re.compile(r"[.,;:!?]+|\bbut\b|\bhowever\b|\balthough\b|\bthough\b")


def _plain(answer: str) -> str:
    text = answer.lower().replace("\u2019", "'").replace("`", "'")
    for pattern, replacement in _EXPANSIONS:
        text = re.sub(pattern, replacement, text)
    return " ".join(text.split())


def _clause_verdict(clause: str) -> str | None:
    if _YES_WORD.match(clause):
        return YES
    if _NO_WORD.match(clause) or _DENIAL.search(clause):
        return NO
    if _ASSERTION.search(clause) and not _NEGATION.search(clause):
        return YES
    return None


def classify(answer: str) -> str:
    """yes, no or unclear.

    The verdict is the first clause that says yes or no (a leading "yes"/"no", "there is no
    ...", "I don't see ...", "there is a ...", "I can see ..."). An answer that hedges ("not
    sure", "maybe") is unclear, and so is one whose later clause contradicts its verdict: "No,
    but there is a giraffe on the left." denies and then asserts the object, so it is unclear,
    never credited as a no (nor as a yes). An answer with no such clause follows POPE's rule:
    no if it holds a negation, else yes.
    """
    text = _plain(answer)
    if not text or _UNSURE.search(text):
        return UNCLEAR
    verdicts = [v for clause in _CLAUSES.split(text) if (v := _clause_verdict(clause.strip()))]
    if not verdicts:
        return NO if _NEGATION.search(text) else YES
    first = verdicts[0]
    return first if all(v == first for v in verdicts[1:]) else UNCLEAR


def truth(answers: Sequence[str]) -> str:
    """The right answer of a presence question from its accepted answers (yes or no)."""
    verdict = classify(answers[0]) if answers else UNCLEAR
    if verdict == UNCLEAR:
        raise ValueError("a presence question's answer must be yes or no")
    return verdict


def _pope(tp, fp, tn, fn, unclear):
    """Accuracy, precision, recall, F1 and yes-ratio from counts (arrays: one per resample)."""
    total = tp + fp + tn + fn + unclear
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(tp + fp > 0, tp / np.maximum(tp + fp, 1), 0.0)
        recall = np.where(tp + fn > 0, tp / np.maximum(tp + fn, 1), 0.0)
        f1 = np.where(precision + recall > 0, 2 * precision * recall / np.maximum(precision + recall, 1e-12), 0.0)
    return (tp + tn) / total, precision, recall, f1, (tp + fp) / total


def pope(pairs: Sequence[tuple[str, str]]) -> dict:
    """POPE's figures for (truth, answered) pairs, truth yes/no and answered yes/no/unclear.

    An unclear answer is wrong: it lowers accuracy, is a miss when the truth is yes (recall)
    and is not a yes (the yes-ratio). Each share has its Wilson interval; F1 a bootstrap one.
    """
    if not pairs:
        return {"items": 0}
    rows = np.array([[t == YES and a == YES, t == NO and a == YES, t == NO and a == NO,
                      t == YES and a != YES, t == NO and a == UNCLEAR] for t, a in pairs], dtype=float)
    tp, fp, tn, fn, unclear_no = (int(v) for v in rows.sum(axis=0))
    accuracy, precision, recall, f1, yes_ratio = (float(v) for v in _pope(tp, fp, tn, fn, unclear_no))

    def f1_of(samples):  # samples: resamples x items x counts
        counts = samples.sum(axis=1)
        return _pope(*(counts[:, i] for i in range(5)))[3]

    def rounded(interval):
        return None if interval is None else [round(interval[0], 4), round(interval[1], 4)]

    return {
        "items": len(pairs), "tp": tp, "fp": fp, "tn": tn, "fn": fn,
        "unclear": sum(1 for _, a in pairs if a == UNCLEAR),
        "accuracy": round(accuracy, 4), "accuracy_ci": rounded(intervals.wilson(tp + tn, len(pairs))),
        "precision": round(precision, 4), "precision_ci": rounded(intervals.wilson(tp, tp + fp)),
        "recall": round(recall, 4), "recall_ci": rounded(intervals.wilson(tp, tp + fn)),
        "f1": round(f1, 4), "f1_ci": rounded(intervals.bootstrap(rows, f1_of)),
        "yes_ratio": round(yes_ratio, 4),
    }
