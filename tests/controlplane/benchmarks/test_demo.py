from __future__ import annotations

import pytest

from controlplane.benchmarks.models import BenchmarkProfile
from controlplane.benchmarks.services import workload_for
from controlplane.demo import seed_demo

pytestmark = pytest.mark.django_db


def test_the_demo_ships_a_text_baseline_and_a_mixed_profile_for_the_flagship():
    seed_demo()
    seed_demo()  # twice: nothing doubles
    profiles = {p.name: p for p in BenchmarkProfile.objects.all()}
    assert set(profiles) == {"text-baseline", "mixed-images"}
    for profile in profiles.values():
        profile.full_clean()
        assert profile.tier.name == "vlm-flagship" and profile.target == "gateway"
    # the same text rate in both: the mixed one doubles the rate at half the text share
    assert [r * profiles["mixed-images"].text_share for r in profiles["mixed-images"].sweep] == \
        profiles["text-baseline"].sweep
    specs = [workload_for(profiles["mixed-images"]).spec(n) for n in range(200)]
    # up to the flagship's cap, the large bucket costs over 4,000 tokens an image
    assert max(s.image_tokens for s in specs) > 4000
