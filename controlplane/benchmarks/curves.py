"""A resolution sweep's quality–cost curve and its answers as rows for a file: per cap the
whole set's accuracy, then each task's headline metric, each with its 95 % interval, beside
the cap's tokens, costs and latencies.

Pure: no Django. Rows carry typed values (ints, floats, Decimal money, None for unknown).
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

from controlplane.benchmarks import scoring

CURVE_COLUMNS = ["cap", "task", "metric", "value", "low", "high", "items", "image_tokens", "cost_per_image",
                 "cost_per_right_answer", "ttft_p50_ms", "e2e_p50_ms"]
ANSWER_COLUMNS = ["cap", "item", "task", "answer", "score", "read_as", "confidence", "cost"]
SET = "all"  # the task column of the whole set's row


def _money(value) -> Decimal | None:
    return None if value is None else Decimal(str(value))


def curve_rows(results: dict) -> Iterator[list]:
    for cap in results.get("caps") or []:
        shared = [cap.get("mean_image_tokens"), _money(cap.get("cost_per_image")),
                  _money(cap.get("cost_per_right_answer")), (cap.get("ttft") or {}).get("p50"),
                  (cap.get("e2e") or {}).get("p50")]
        overall = cap.get("overall")
        if overall:
            low, high = overall.get("interval") or (None, None)
            yield [cap["cap"], SET, "accuracy", overall.get("accuracy"), low, high, overall.get("items"), *shared]
        for task, figures in (cap.get("tasks") or {}).items():
            low, high = figures.get("interval") or (None, None)
            yield [cap["cap"], task, figures.get("metric", "anls"), scoring.headline(figures), low, high,
                   figures.get("items"), *shared]


def answer_rows(results: dict) -> Iterator[list]:
    for cap in results.get("caps") or []:
        for answer in cap.get("answers") or []:
            yield [*answer, *[None] * (len(ANSWER_COLUMNS) - len(answer))]  # older runs kept fewer
