"""Answer scoring for labelled evaluation sets, as the field scores each kind of question.
Pure functions: no Django, no I/O.

- exact match, after VQAv2's normalisation (case, punctuation, articles, number words to
  digits, contractions);
- VQA accuracy: min(references that match / 3, 1), averaged over the ten leave-one-out
  subsets of ten references as VQAv2 does; with fewer references, a plain match;
- ANLS (DocVQA): 1 - the normalised edit distance to the nearest reference, 0 from a distance
  of 0.5 up;
- relaxed accuracy (ChartQA): a number within 5 % of the reference, exact match otherwise;
- presence (POPE): the answer read as yes, no or unclear (presence.py).

Each task type has one headline metric (TASKS), reported with its 95 % interval.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane import intervals
from controlplane.benchmarks import presence


@dataclass(frozen=True)
class Task:
    label: str
    metric: str  # the headline: a key of METRICS, or "f1" for presence (with its accuracy)


# The one table of task types and the figure each is judged by.
TASKS = {
    "read": Task("reading text and numbers", "anls"),
    "chart": Task("chart reading", "relaxed_accuracy"),
    "count": Task("counting", "exact_match"),
    "presence": Task("presence (yes/no, as POPE)", "f1"),
    "description": Task("description", "anls"),
    "reasoning": Task("reasoning", "vqa_accuracy"),
    "long": Task("tall or wide images", "anls"),
}
METRIC_NAMES = {"anls": "ANLS", "relaxed_accuracy": "relaxed accuracy", "exact_match": "exact match",
                "vqa_accuracy": "VQA accuracy", "f1": "F1", "accuracy": "accuracy"}
ANLS_THRESHOLD = 0.5
RELAXED_TOLERANCE = 0.05

_NUMBER_WORDS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
                 "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11",
                 "twelve": "12"}
_ARTICLES = {"a", "an", "the"}
# Contractions as answers often spell them, without their apostrophe.
_CONTRACTIONS = {
    "arent": "aren't", "cant": "can't", "couldnt": "couldn't", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hasnt": "hasn't", "havent": "haven't", "isnt": "isn't",
    "itll": "it'll", "ive": "i've", "shouldnt": "shouldn't", "thats": "that's", "theres": "there's",
    "theyre": "they're", "wasnt": "wasn't", "werent": "weren't", "whats": "what's", "wont": "won't",
    "wouldnt": "wouldn't", "youre": "you're", "im": "i'm", "lets": "let's",
}
_PUNCTUATION = ";/[]\"{}()=+\\_-><@`,?!"
_DIGIT_COMMA = re.compile(r"(\d),(\d)")
_LONE_PERIOD = re.compile(r"\.(?!\d)")


def normalise(text: str) -> str:
    """An answer as VQAv2's evaluation compares it: lower case, its punctuation marks dropped
    (a comma between digits and a decimal point kept whole), articles dropped, number words as
    digits, contractions with their apostrophe."""
    text = " ".join(str(text).replace("\u2019", "'").lower().split())
    text = _DIGIT_COMMA.sub(r"\1\2", text)
    text = "".join(" " if ch in _PUNCTUATION else ch for ch in text)
    text = _LONE_PERIOD.sub("", text)
    words = [_NUMBER_WORDS.get(word, word) for word in text.split()]
    return " ".join(_CONTRACTIONS.get(word, word) for word in words if word not in _ARTICLES)


def _options(expected: str | Sequence[str]) -> list[str]:
    return [expected] if isinstance(expected, str) else list(expected)


def exact_match(answer: str, expected: str | Sequence[str]) -> float:
    mine = normalise(answer)
    return 1.0 if any(mine == normalise(option) for option in _options(expected)) else 0.0


def vqa_accuracy(answer: str, references: Sequence[str]) -> float:
    """VQAv2's accuracy: with ten references, min(others that match / 3, 1) averaged over
    each reference left out in turn; with fewer, 1 for a match of any."""
    references = _options(references)
    mine = normalise(answer)
    matches = [normalise(reference) == mine for reference in references]
    if len(references) < 10:
        return 1.0 if any(matches) else 0.0
    hits = sum(matches)
    return sum(min(1.0, (hits - left_out) / 3) for left_out in matches) / len(matches)


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


def anls(answer: str, expected: str | Sequence[str]) -> float:
    """The best similarity over the references, 0 where the normalised distance is 0.5 or more."""
    best = 0.0
    left = " ".join(answer.lower().split())
    for option in _options(expected):
        right = " ".join(option.lower().split())
        longest = max(len(left), len(right))
        distance = 0.0 if longest == 0 else levenshtein(left, right) / longest
        best = max(best, 1 - distance if distance < ANLS_THRESHOLD else 0.0)
    return best


_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(e[-+]?\d+)?$")
_NUMBER_IN_TEXT = re.compile(r"[-+]?[$€£]?\d[\d,]*(\.\d+)?%?")


def parse_number(text: str) -> tuple[float, bool] | None:
    """A number as charts write it ("1,234", "12.5%", "$3", "-0.5"), and whether it was a
    percentage; None if the text is not one number."""
    text = text.strip().lower().rstrip(".").strip()
    for symbol in ("$", "€", "£"):
        text = text.replace(symbol, "")
    percent = text.endswith("%")
    text = text.rstrip("%").strip()
    if _DIGIT_COMMA.search(text):
        text = text.replace(",", "")
    if not _NUMBER.match(text):
        return None
    return float(text), percent


def _stated_number(answer: str) -> tuple[float, bool] | None:
    """The number an answer states: the whole answer, or the one number in a sentence."""
    parsed = parse_number(answer)
    if parsed is not None:
        return parsed
    found = [m.group(0) for m in _NUMBER_IN_TEXT.finditer(answer)]
    return parse_number(found[0]) if len(found) == 1 else None


def _readings(number: tuple[float, bool]) -> tuple[float, ...]:
    value, percent = number
    return (value, value / 100) if percent else (value,)


def relaxed_accuracy(answer: str, expected: str | Sequence[str]) -> float:
    """ChartQA's relaxed accuracy: right if within 5 % of a numeric reference (exactly equal
    to a reference of 0), else exact match. A percentage answer matches either the same number
    or its fraction ("12.5%" matches 12.5 and 0.125); an answer that is a sentence is read by
    the one number it states."""
    mine = _stated_number(answer)
    for option in _options(expected):
        reference = parse_number(option)
        if reference is None or mine is None:
            if exact_match(answer, option):
                return 1.0
            continue
        for target in _readings(reference):
            for value in _readings(mine):
                if (target == 0 and value == 0) or (
                        target != 0 and abs(value - target) / abs(target) <= RELAXED_TOLERANCE):
                    return 1.0
    return 0.0


def count_match(answer: str, expected: str | Sequence[str]) -> float:
    """Exact match, of the whole answer or of the one number it states ("There are 3.")."""
    if exact_match(answer, expected):
        return 1.0
    words = normalise(answer).split()
    numbers = [w for w in words if w.isdigit()]
    return exact_match(numbers[0], expected) if len(numbers) == 1 else 0.0


METRICS = {"exact_match": exact_match, "vqa_accuracy": vqa_accuracy, "anls": anls,
           "relaxed_accuracy": relaxed_accuracy}


def score(answer: str, expected: Sequence[str], task_type: str) -> dict:
    """One answer's scores: its headline `score` (0..1) by the task's metric, exact match, and
    for a presence question what it was read as (`answered`) and the truth."""
    task = TASKS[task_type]
    if task.metric == "f1":
        answered, right = presence.classify(answer), presence.truth(expected)
        return {"score": float(answered == right), "exact_match": float(answered == right), "answered": answered,
                "truth": right}
    if task_type == "count":
        headline = count_match(answer, expected)
    else:
        headline = METRICS[task.metric](answer, expected)
    return {"score": headline, "exact_match": exact_match(answer, expected)}


def unanswered(expected: Sequence[str], task_type: str) -> dict:
    """The scores of a question the model did not answer (an error): wrong."""
    result = {"score": 0.0, "exact_match": 0.0}
    if TASKS[task_type].metric == "f1":
        result.update(answered=presence.UNCLEAR, truth=presence.truth(expected))
    return result


def _rounded(interval):
    return None if interval is None else [round(interval[0], 4), round(interval[1], 4)]


def summarise(task_type: str, results: Sequence[dict]) -> dict:
    """A task type's figures over its items: the headline metric's value and 95 % interval,
    exact match, and POPE's figures for presence."""
    task = TASKS[task_type]
    scores = [r["score"] for r in results]
    summary = {"items": len(results), "metric": task.metric,
               "exact_match": round(sum(r["exact_match"] for r in results) / len(results), 4) if results else None}
    if task.metric == "f1":
        figures = presence.pope([(r["truth"], r["answered"]) for r in results])
        summary.update(value=figures.get("f1"), interval=figures.get("f1_ci"), pope=figures)
        return summary
    summary.update(value=round(sum(scores) / len(scores), 4) if scores else None,
                   interval=_rounded(intervals.mean_interval(scores)))
    return summary


def headline(figures: dict) -> float | None:
    """The headline value of a task's figures, including those stored before headlines were
    (which had exact match and ANLS only)."""
    if "value" in figures:
        return figures["value"]
    return figures.get("anls")
