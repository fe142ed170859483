"""Answer scoring for labelled evaluation sets. Pure functions: no Django, no I/O.

- exact match: after normalising case, punctuation, articles and spaces;
- ANLS (average normalised Levenshtein similarity, as DocVQA scores OCR answers): 1 - the
  edit distance over the longer string, counted as 0 below 0.5 similarity;
- the hallucination probe: a question about something absent from the image, answered
  rightly by a negative ("no", "there is none", ...), whatever the expected text says.
"""

from __future__ import annotations

import re
import string

ANLS_THRESHOLD = 0.5
TASK_TYPES = {
    "ocr": "OCR",
    "chart": "chart reading",
    "description": "description",
    "reasoning": "reasoning over image and text",
    "hallucination": "hallucination probe",
}
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NEGATIVE = re.compile(
    r"^(no|none|nothing|not|never|nope|there (is|are) (no|not|none)|i (do not|dont|cannot|cant) see"
    r"|i see no|(the )?(image|picture|photo) (does not|doesnt) (show|contain|have))\b")


def normalise(text: str) -> str:
    text = text.lower().strip()
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(answer: str, expected: str | list[str]) -> float:
    options = [expected] if isinstance(expected, str) else expected
    return 1.0 if any(normalise(answer) == normalise(option) for option in options) else 0.0


def levenshtein(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls(answer: str, expected: str | list[str]) -> float:
    """The best similarity over the accepted answers, 0 under the threshold."""
    options = [expected] if isinstance(expected, str) else expected
    best = 0.0
    left = " ".join(answer.lower().split())
    for option in options:
        right = " ".join(option.lower().split())
        longest = max(len(left), len(right))
        similarity = 1.0 if longest == 0 else 1 - levenshtein(left, right) / longest
        best = max(best, similarity if similarity >= ANLS_THRESHOLD else 0.0)
    return best


def is_negative(answer: str) -> bool:
    text = " ".join(re.sub(r"[^\w\s]", "", answer.lower()).split())  # "don't" -> "dont"
    return bool(_NEGATIVE.match(text))


def score(answer: str, expected: str | list[str], task_type: str) -> dict:
    """Exact match and ANLS of one answer; a probe scores 1 for a negative, 0 otherwise."""
    if task_type == "hallucination":
        right = 1.0 if is_negative(answer) else 0.0
        return {"exact_match": right, "anls": right}
    return {"exact_match": exact_match(answer, expected), "anls": anls(answer, expected)}
