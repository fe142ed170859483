"""Moving a profile's own evaluation items into a set of their own, as the upgrade does."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from controlplane.benchmarks.models import BenchmarkProfile, EvalSet
from tests.images import image_bytes

BEFORE = [("benchmarks", "0006_eval_sets")]
AFTER = [("benchmarks", "0008_eval_items_in_sets")]


@pytest.fixture
def latest_schema_after():
    """The tests that follow in this process need every migration applied again."""
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("latest_schema_after")
def test_each_profiles_items_become_a_set_it_uses_and_probes_become_presence_questions(world):
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    try:
        old = executor.loader.project_state(BEFORE).apps
        Profile, Item = old.get_model("benchmarks", "BenchmarkProfile"), old.get_model("benchmarks", "EvalItem")
        receipts = Profile.objects.create(name="receipts", tier_id=world.vision.pk, kind="resolution", sweep=[1])
        Profile.objects.create(name="plain", tier_id=world.vision.pk, sweep=[1])
        common = {"content_type": "image/jpeg", "width": 8, "height": 8, "data": image_bytes(8, 8)}
        Item.objects.create(profile=receipts, task_type="ocr", question="Total?", expected="42.50\n $42.50 \n",
                            name="r1.jpg", **common)
        Item.objects.create(profile=receipts, task_type="hallucination", question="Is there a giraffe?",
                            expected="there is none", name="r2.jpg", **common)
        Item.objects.create(profile=receipts, task_type="chart", question="Peak?", expected="7", name="r3.jpg",
                            **common)
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(AFTER)
    profile = BenchmarkProfile.objects.get(name="receipts")
    eval_set = EvalSet.objects.get()
    assert profile.eval_set == eval_set and BenchmarkProfile.objects.get(name="plain").eval_set is None
    assert (eval_set.name, eval_set.source) == ("receipts items", "profile")
    items = {i.task_type: i for i in eval_set.items.all()}
    assert sorted(items) == ["chart", "presence", "read"]
    assert items["read"].answers == ["42.50", "$42.50"] and items["read"].meta == {"name": "r1.jpg"}
    assert items["presence"].answers == ["no"] and items["presence"].question == "Is there a giraffe?"
    assert items["chart"].answers == ["7"]
    assert sorted(i.row for i in items.values()) == [1, 2, 3]
    assert bytes(items["chart"].data) == image_bytes(8, 8)
