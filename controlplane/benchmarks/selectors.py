"""Reads for the benchmark pages: rows of result tables and the comparison of two runs."""

from __future__ import annotations

from decimal import Decimal

from controlplane.benchmarks.advisor import Point
from controlplane.benchmarks.models import BenchmarkRun
from controlplane.benchmarks.scoring import METRIC_NAMES, headline
from controlplane.benchmarks.workload import CLASS_NAMES

# (label, path into a class summary) for the comparison table
COMPARED = [
    ("TTFT p50 (ms)", ("ttft", "p50")), ("TTFT p99 (ms)", ("ttft", "p99")),
    ("TPOT p99 (ms)", ("tpot", "p99")), ("E2E p99 (ms)", ("e2e", "p99")),
    ("goodput (req/s)", ("goodput_per_s",)),
]


def _dig(value, path):
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def stage_rows(results: dict) -> list[dict]:
    """One row per stage and request class ("all" first), for the results table."""
    rows = []
    for n, stage in enumerate(results.get("stages") or []):
        for klass, figures in [("all", stage["all"]), *stage["classes"].items()]:
            rows.append({"stage": n + 1, "level": stage["level"], "klass": CLASS_NAMES.get(klass, klass),
                         "figures": figures, "stage_summary": stage, "first": klass == "all"})
    return rows


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(a: BenchmarkRun, b: BenchmarkRun) -> list[tuple[str, object, object]]:
    """What differs between the two runs' profile and tier settings."""
    before, after = _flatten(a.config or {}), _flatten(b.config or {})
    return [(key, before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key)]


def _change(before, after):
    if not isinstance(before, int | float) or not isinstance(after, int | float) or not before:
        return None
    return round(100 * (after - before) / before, 1)


def comparison_rows(a: BenchmarkRun, b: BenchmarkRun) -> list[dict]:
    """Stages matched by load level, then class by class: each figure before, after, change."""
    stages_b = {stage["level"]: stage for stage in b.results.get("stages") or []}
    rows = []
    for stage_a in a.results.get("stages") or []:
        stage_b = stages_b.get(stage_a["level"])
        if stage_b is None:
            continue
        classes = ["all", *[k for k in stage_a["classes"] if k in stage_b["classes"]]]
        for klass in classes:
            fa = stage_a["all"] if klass == "all" else stage_a["classes"][klass]
            fb = stage_b["all"] if klass == "all" else stage_b["classes"][klass]
            cells = []
            for label, path in COMPARED:
                before, after = _dig(fa, path), _dig(fb, path)
                cells.append({"label": label, "a": before, "b": after, "change": _change(before, after)})
            rows.append({"level": stage_a["level"], "klass": CLASS_NAMES.get(klass, klass), "cells": cells})
    return rows


def cap_rows(a: BenchmarkRun, b: BenchmarkRun) -> list[dict]:
    """Resolution sweeps side by side: each pixel cap both ran, with tokens, cost and each
    task's headline metric with its interval."""
    caps_b = {cap["cap"]: cap for cap in b.results.get("caps") or []}
    rows = []
    for cap_a in a.results.get("caps") or []:
        cap_b = caps_b.get(cap_a["cap"])
        if cap_b is None:
            continue
        tasks = sorted(set(cap_a["tasks"]) | set(cap_b["tasks"]))
        rows.append({"cap": cap_a["cap"], "a": cap_a, "b": cap_b,
                     "tasks": [{"task": t, "a": _headline(cap_a, t, headline), "b": _headline(cap_b, t, headline),
                                "a_interval": (cap_a["tasks"].get(t) or {}).get("interval"),
                                "b_interval": (cap_b["tasks"].get(t) or {}).get("interval")}
                               for t in tasks]})
    return rows


def _headline(cap: dict, task: str, headline):
    figures = cap["tasks"].get(task)
    return headline(figures) if figures else None


def cap_task_rows(caps: list[dict]) -> list[dict]:
    """Each cap of a resolution sweep with its tasks' headlines, named, for the results table."""
    rows = []
    for cap in caps:
        tasks = [{"task": task, "metric": METRIC_NAMES.get(figures.get("metric", "anls"), ""),
                  "value": headline(figures), "interval": figures.get("interval"), "items": figures.get("items"),
                  "pope": figures.get("pope")}
                 for task, figures in cap["tasks"].items()]
        rows.append({**cap, "task_rows": tasks})
    return rows


def curve_points(results: dict) -> list:
    """A resolution sweep's quality–cost curve for the advisor: each cap with its accuracy on
    the whole set (`overall`), that accuracy's interval and its cost per image. Caps without
    a figure for the set (unlabelled items, or nothing answered) are left out."""
    points = []
    for cap in results.get("caps") or []:
        overall = cap.get("overall") or {}
        if overall.get("accuracy") is None or not overall.get("interval"):
            continue
        cost = cap.get("cost_per_image")
        points.append(Point(cap=cap["cap"], accuracy=overall["accuracy"], low=overall["interval"][0],
                            high=overall["interval"][1], items=overall.get("items") or 0,
                            cost_per_image=None if cost is None else Decimal(str(cost)),
                            image_tokens=cap.get("mean_image_tokens")))
    return points


def run_currency(run: BenchmarkRun) -> str:
    """What a run's costs are in: those of its tier's price plan."""
    return run.profile.tier.price_plan.currency


def runs_currency(runs: list[BenchmarkRun]) -> str:
    """What a chart of several runs' costs is in: their one currency, or each run's own."""
    currencies = sorted({run_currency(run) for run in runs})
    return currencies[0] if len(currencies) == 1 else "each run's: " + ", ".join(currencies)
