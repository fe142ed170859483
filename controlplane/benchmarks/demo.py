"""The demo's benchmark profiles (seeded with the demo world, see controlplane/demo.py)."""

from __future__ import annotations

from controlplane.benchmarks.models import BenchmarkProfile
from controlplane.catalog.models import ModelTier

# The demo tier whose policy lets images reach past 4,000 tokens.
TIER = "vlm-flagship"
COMMON = {"target": BenchmarkProfile.Target.GATEWAY, "gateway_url": "",  # this server's own gateway
          "arrival": BenchmarkProfile.Arrival.OPEN, "stage_duration_s": 20.0, "seed": 1,
          "prompt_tokens_min": 64, "prompt_tokens_max": 160, "output_tokens_min": 32, "output_tokens_max": 64,
          "ttft_slo_ms": 250, "tpot_slo_ms": 50,
          "image_buckets": [{"width": 640, "height": 480, "weight": 3}, {"width": 1792, "height": 1792, "weight": 2}]}
PROFILES = {
    "text-baseline": {"description": "Text requests alone: the latency text should keep.",
                      "text_share": 1.0, "sweep": [2, 4]},
    "mixed-images": {"description": "The same text rate with as many image requests beside it, two in five "
                                    "of them large. Run it before and after isolating large images (engine "
                                    "settings large_pool_replicas 1 and scheduling_policy priority, a "
                                    "large-image threshold of 2000), then compare the two runs.",
                     "text_share": 0.5, "sweep": [4, 8]},
}


def seed_benchmark_profiles() -> None:
    tier = ModelTier.objects.filter(name=TIER).first()
    if tier is None:
        return
    for name, fields in PROFILES.items():
        BenchmarkProfile.objects.get_or_create(name=name, defaults={"tier": tier, **COMMON, **fields})
