"""A policy judged before it serves: each item's image made as the gateway would make it."""

from __future__ import annotations

import dataclasses

from controlplane.benchmarks.resolution import Item, under_policy, variant_specs
from controlplane.imaging.policy import Policy
from tests.images import image_bytes


def receipt() -> Item:
    return Item(key="receipt", data=image_bytes(1000, 15000, "PNG"), width=1000, height=15000,
                content_type="image/png", question="What is the total?", task_type="read", answers=("42.50",))


def test_a_long_receipt_under_the_default_policy_is_cut_into_legible_tiles():
    images = under_policy(Policy(grid=28))(receipt())
    assert [(w, h) for _, w, h, _ in images] == [(504, 1932)] * 4  # twice as wide as squashed whole


def test_a_looser_aspect_bound_squashes_the_receipt_into_one_narrow_image():
    images = under_policy(Policy(grid=28, max_aspect_ratio=20))(receipt())
    assert [(w, h) for _, w, h, _ in images] == [(252, 3864)]


def test_each_variant_is_a_stage_asking_every_item_with_all_its_images():
    item = receipt()
    squashed, tiled = Policy(grid=28, max_aspect_ratio=20), Policy(grid=28)
    stages = variant_specs([item, dataclasses.replace(item, key="again")],
                           [under_policy(squashed), under_policy(tiled)], max_tokens=8,
                           estimate_tokens=lambda w, h: w * h // 784)
    assert [len(stage) for stage in stages] == [2, 2]
    assert len({spec.index for stage in stages for spec in stage}) == 4
    tiled_spec = stages[1][0]
    parts = tiled_spec.body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url"] * 4 + ["text"]
    assert tiled_spec.images == 4 and tiled_spec.image_tokens == sum(w * h // 784 for w, h in tiled_spec.sizes)
    assert stages[0][0].meta == {"item": "receipt", "task_type": "read", "answers": ["42.50"]}
