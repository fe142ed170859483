"""Benchmark profiles and finished runs as the benchmarks' tests need them, and the form a
profile is edited with."""

from __future__ import annotations

import json

from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun


def make_profile(tier, **fields) -> BenchmarkProfile:
    defaults = {"name": "smoke", "target": "instance", "text_share": 0.5, "sweep": [2],
                "stage_duration_s": 1.0, "image_buckets": [{"width": 640, "height": 480, "weight": 1}],
                "prompt_tokens_min": 16, "prompt_tokens_max": 32, "output_tokens_min": 8,
                "output_tokens_max": 16, "ttft_slo_ms": 5000, "tpot_slo_ms": 1000}
    profile = BenchmarkProfile(tier=tier, **{**defaults, **fields})
    profile.full_clean()
    profile.save()
    return profile


def form_data(world, **overrides):
    data = {"name": "mixed", "description": "", "tier": world.vision.pk, "target": "gateway",
            "gateway_url": "", "instance": "", "text_share": "0.5",
            "images_per_request_min": "1", "images_per_request_max": "2", "image_source": "buckets",
            "image_buckets": json.dumps([{"width": 640, "height": 480, "weight": 3}]),
            "prompt_tokens_min": "32", "prompt_tokens_max": "64", "output_tokens_min": "16",
            "output_tokens_max": "32", "arrival": "open", "sweep": "[1, 2.5, 5]", "stage_duration_s": "20",
            "seed": "0", "kind": "load", "pixel_caps": "[200704, 1003520]", "ttft_slo_ms": "800",
            "tpot_slo_ms": "50", "schedule_cron": ""}
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


def finished_run(profile, label, ttft_p99_text, level=4.0, **config):
    def figures(p99):
        dist = {"p50": p99 / 2, "p90": p99 * 0.9, "p99": p99, "mean": p99 / 2}
        return {"requests": 10, "errors": 0, "ttft": dist, "tpot": dist, "itl": dist, "e2e": dist,
                "slo_attained": 9, "goodput_per_s": 1.5, "mean_image_tokens": 0}
    stage = {"level": level, "duration_s": 6.0, "requests": 20, "errors": 0, "error_examples": [],
             "throughput": {"requests_per_s": 3.3, "output_tokens_per_s": 100.0, "image_tokens_per_s": 900.0},
             "goodput": {"requests_per_s": 3.0, "share": 0.9}, "all": figures(ttft_p99_text),
             "classes": {"text": figures(ttft_p99_text), "image": figures(500.0)},
             "cost": {"per_image": "0.000321", "per_request": {}, "total": "0.01"}}
    return BenchmarkRun.objects.create(profile=profile, label=label, state="succeeded", progress=1.0,
                                       config={"sweep": [level], "tier": {"engine_settings": config}},
                                       results={"arrival": "closed", "stages": [stage]}, log="done\n")


# (cap, accuracy, interval, cost per image): the smallest cap is measurably worse than the best;
# the middle one is within the noise of it.
CURVE = ((200_704, 0.70, [0.61, 0.78], "0.000039"), (401_408, 0.86, [0.78, 0.91], "0.000080"),
         (1_003_520, 0.88, [0.80, 0.93], "0.000192"))


def sweep(profile, curve=CURVE, **fields) -> BenchmarkRun:
    dist = {"p50": 40.0, "p90": 50.0, "p99": 60.0, "mean": 45.0}
    caps = [{"cap": cap, "requests": 100, "errors": 0, "mean_image_tokens": cap / 784, "mean_output_tokens": 4,
             "ttft": dist, "e2e": dist, "cost_per_image": cost, "cost_per_right_answer": None,
             "tasks": {"read": {"items": 100, "metric": "anls", "value": accuracy, "interval": interval}},
             "overall": {"accuracy": accuracy, "interval": interval, "answered": 100, "items": 100,
                         "mean_image_tokens": cap / 784},
             "answers": [[cap, "row-1", "read", "42", 1.0, ""]]}
            for cap, accuracy, interval, cost in curve]
    fields = {"state": "succeeded", "progress": 1.0, **fields}
    return BenchmarkRun.objects.create(
        profile=profile, config={"kind": "resolution", "pixel_caps": [c[0] for c in curve], "eval_set": "receipts",
                                 "tier": {"name": profile.tier.name}},
        results={"kind": "resolution", "caps": caps}, **fields)
