"""Resolution sweeps: answers scored (exact match, ANLS, the hallucination probe), images
scaled to each cap, and a sweep run end to end against a real engine."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from controlplane.benchmarks import scoring
from controlplane.benchmarks.models import BenchmarkRun, EvalItem
from controlplane.benchmarks.resolution import Item, scaled, sweep_specs
from controlplane.benchmarks.services import benchmark_execute
from tests.controlplane.benchmarks.conftest import make_profile
from tests.images import image_bytes


@pytest.mark.parametrize("answer, expected, em", [
    ("The Eiffel Tower.", "eiffel tower", 1.0),
    ("  42  ", "42", 1.0),
    ("42.5", "42", 0.0),
    ("$42.50", ["42.50", "$42.50"], 1.0),  # any accepted answer
])
def test_exact_match_ignores_case_punctuation_and_articles(answer, expected, em):
    assert scoring.exact_match(answer, expected) == em


def test_anls_is_one_minus_the_normalised_edit_distance_and_zero_under_half():
    assert scoring.anls("TOTAL 42.50", "total 42.50") == 1.0
    assert scoring.anls("4250", "42.50") == pytest.approx(0.8)  # one edit in five characters
    assert scoring.anls("hello", "world") == 0.0  # 0.2 similarity is under the threshold
    assert scoring.anls("invoice 17", ["receipt 17", "invoice 17"]) == 1.0  # the best accepted answer
    assert scoring.levenshtein("kitten", "sitting") == 3


@pytest.mark.parametrize("answer, right", [
    ("No.", True), ("There is no dog in this picture.", True), ("I don't see any giraffe.", True),
    ("The image does not contain a cat", True), ("Nothing like that.", True),
    ("Yes, a small dog on the left.", False), ("Notably, a dog sits there.", False),
])
def test_the_hallucination_probe_wants_a_negative(answer, right):
    assert scoring.score(answer, "no", "hallucination") == {"exact_match": float(right), "anls": float(right)}


def test_images_are_scaled_within_each_cap_keeping_their_aspect_and_never_enlarged():
    item = Item(key="k", data=image_bytes(2000, 1000), width=2000, height=1000)
    data, width, height, content_type = scaled(item, 500_000)
    assert width * height <= 500_000 and abs(width / height - 2) < 0.01
    assert Image.open(io.BytesIO(data)).size == (width, height) and content_type == "image/jpeg"
    assert scaled(item, 4_000_000)[0] == item.data  # already within: sent as it is
    png = Item(key="p", data=image_bytes(800, 800, "PNG"), width=800, height=800, content_type="image/png")
    assert scaled(png, 160_000)[3] == "image/png"


def test_a_sweep_asks_the_same_question_of_each_item_at_each_cap():
    items = [Item(key="a", data=image_bytes(1600, 1200), width=1600, height=1200, question="What is it?",
                  task_type="description", expected=("a red square",))]
    stages = sweep_specs(items, [200_000, 1_000_000], max_tokens=8, estimate_tokens=lambda w, h: w * h // 784)
    assert [len(stage) for stage in stages] == [1, 1]
    low, high = stages[0][0], stages[1][0]
    assert low.index != high.index and low.meta == high.meta
    assert low.image_tokens < high.image_tokens and low.image_pixels <= 200_000
    assert low.body["messages"][0]["content"][1]["text"] == "What is it?"


@pytest.mark.django_db
def test_a_resolution_sweep_reports_tokens_cost_and_accuracy_per_cap_and_task(world, instance):
    profile = make_profile(world.vision, kind="resolution", pixel_caps=[50_176, 200_704], sweep=[2],
                           output_tokens_min=5, output_tokens_max=5)
    # The simulator answers "image 1 <W>x<H> <tokens> tokens ...": at 5 tokens its answer names
    # the size it received, so the full-size item is read right only at the larger cap.
    EvalItem.objects.create(profile=profile, task_type="ocr", question="What size is this?",
                            expected="image 1 448x448 258 tokens", name="square.png", content_type="image/png",
                            width=448, height=448, data=image_bytes(448, 448, "PNG"))
    EvalItem.objects.create(profile=profile, task_type="hallucination", question="Is there a giraffe?",
                            expected="no", name="square.jpg", content_type="image/jpeg", width=448, height=448,
                            data=image_bytes(448, 448))
    run = BenchmarkRun.objects.create(profile=profile)
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "succeeded", run.log
    low, high = run.results["caps"]
    assert (low["cap"], high["cap"]) == (50_176, 200_704)
    assert low["errors"] == high["errors"] == 0
    assert low["mean_image_tokens"] < high["mean_image_tokens"] == 258
    assert high["tasks"]["ocr"] == {"items": 1, "exact_match": 1.0, "anls": 1.0}
    assert low["tasks"]["ocr"]["exact_match"] == 0.0 and 0.5 < low["tasks"]["ocr"]["anls"] < 1.0
    assert high["tasks"]["hallucination"]["anls"] == 0.0  # the simulator never says no
    assert float(low["cost_per_image"]) < float(high["cost_per_image"])
    assert "ANLS" in run.log
