"""Resolution sweeps: images scaled to each cap, and a sweep run end to end against a real
engine, each task type scored by its headline metric with its interval."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from controlplane.benchmarks.models import BenchmarkRun, EvalItem, EvalSet
from controlplane.benchmarks.resolution import Item, scaled, sweep_specs
from controlplane.benchmarks.services import benchmark_execute, profile_config
from tests.controlplane.benchmarks.runs import make_profile
from tests.images import image_bytes


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
                  task_type="description", answers=("a red square",))]
    stages = sweep_specs(items, [200_000, 1_000_000], max_tokens=8, estimate_tokens=lambda w, h: w * h // 784)
    assert [len(stage) for stage in stages] == [1, 1]
    low, high = stages[0][0], stages[1][0]
    assert low.index != high.index and low.meta == high.meta
    assert low.image_tokens < high.image_tokens and low.image_pixels <= 200_000
    assert low.body["messages"][0]["content"][1]["text"] == "What is it?"


@pytest.mark.django_db
def test_a_resolution_sweep_reports_tokens_cost_and_each_tasks_headline_per_cap(world, instance):
    # The simulator answers "image 1 <W>x<H> <tokens> tokens ...": at 5 tokens its answer names
    # the size it received, so the full-size item is read right only at the larger cap.
    eval_set = EvalSet.objects.create(name="sizes", source="imported", file_name="sizes.jsonl")
    EvalItem.objects.create(eval_set=eval_set, row=1, task_type="read", question="What size is this?",
                            answers=["image 1 448x448 258 tokens"], content_type="image/png",
                            width=448, height=448, data=image_bytes(448, 448, "PNG"))
    EvalItem.objects.create(eval_set=eval_set, row=2, task_type="presence", question="Is there a giraffe?",
                            answers=["no"], content_type="image/jpeg", width=448, height=448,
                            data=image_bytes(448, 448))
    profile = make_profile(world.vision, kind="resolution", pixel_caps=[50_176, 200_704], sweep=[2],
                           output_tokens_min=5, output_tokens_max=5, eval_set=eval_set)
    run = BenchmarkRun.objects.create(profile=profile)
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "succeeded", run.log
    low, high = run.results["caps"]
    assert (low["cap"], high["cap"]) == (50_176, 200_704)
    assert low["errors"] == high["errors"] == 0
    assert low["mean_image_tokens"] < high["mean_image_tokens"] == 258
    read = high["tasks"]["read"]
    assert (read["metric"], read["items"], read["value"]) == ("anls", 1, 1.0)
    assert read["interval"][0] < 1.0 == read["interval"][1]  # one item proves little: a wide interval
    assert 0.5 < low["tasks"]["read"]["value"] < 1.0
    presence = high["tasks"]["presence"]  # the simulator never says no
    assert presence["metric"] == "f1" and presence["pope"]["accuracy"] == 0.0
    assert presence["pope"]["yes_ratio"] == 1.0
    assert float(low["cost_per_image"]) < float(high["cost_per_image"])
    assert high["cost_per_right_answer"] is not None and low["cost_per_right_answer"] is not None
    assert "read ANLS 1.00 [" in run.log
    # Each answer keeps its token probability (surer at the larger cap) and what it cost.
    (low_read, *_), (high_read, *_) = low["answers"], high["answers"]
    assert 0 < low_read[6] < high_read[6] < 1 and 0 < float(low_read[7]) < float(high_read[7])
    config = profile_config(profile)  # what a run records of its settings
    assert config["eval_set"] == "sizes" and config["eval_items"] == 2
