"""Evaluation sets: generated from the built-in generators, imported whole or not at all (each
refused row listed with its number), browsed with thumbnails, chosen by a profile, deleted;
for operators only."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from PIL import Image

from controlplane.benchmarks import evalsets
from controlplane.benchmarks.models import EvalImport, EvalItem, EvalSet
from tests.images import image_bytes, serve_files
from tests.imaging_corpus import png_with_header

pytestmark = pytest.mark.django_db


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def jsonl(rows) -> bytes:
    return "\n".join(json.dumps(row) for row in rows).encode()


def upload(client, name, data, set_name="mine", task_type="read"):
    return client.post("/benchmarks/sets/import/", {
        "name": set_name, "description": "", "task_type": task_type,
        "file": SimpleUploadedFile(name, data, content_type="application/octet-stream")})


def run_queued_import():
    job = EvalImport.objects.get()
    assert job.state == "queued"
    evalsets.evalset_import_execute(import_id=job.pk)
    job.refresh_from_db()
    return job


def test_a_built_in_set_is_generated_from_its_task_count_and_seed(client, world):
    client.force_login(world.operator)
    response = client.post("/benchmarks/sets/generate/", {"name": "counting", "task": "count", "count": "6",
                                                         "seed": "3", "description": ""})
    eval_set = EvalSet.objects.get(name="counting")
    assert response.status_code == 302 and response.url == f"/benchmarks/sets/{eval_set.pk}/"
    assert (eval_set.source, eval_set.generator, eval_set.seed) == ("generated", "count", 3)
    items = list(eval_set.items.all())
    assert [i.row for i in items] == [1, 2, 3, 4, 5, 6] and {i.task_type for i in items} == {"count"}
    assert all(i.answers and i.content_type == "image/png" for i in items)
    again = evalsets.evalset_generate(name="counting again", task="count", count=6, seed=3)
    assert [bytes(i.data) for i in again.items.all()] == [bytes(i.data) for i in items]  # same seed, same set
    page = client.get(f"/benchmarks/sets/{eval_set.pk}/").content.decode()
    assert "generated: count, seed 3" in page and page.count('data-row="') == 6


def test_a_generated_set_needs_a_free_name_and_a_known_task(client, world):
    client.force_login(world.operator)
    EvalSet.objects.create(name="taken", source="imported")
    client.post("/benchmarks/sets/generate/", {"name": "taken", "task": "count", "count": "2", "seed": "0"})
    client.post("/benchmarks/sets/generate/", {"name": "new", "task": "poetry", "count": "2", "seed": "0"})
    client.post("/benchmarks/sets/generate/", {"name": "big", "task": "read", "count": "100000", "seed": "0"})
    assert list(EvalSet.objects.values_list("name", flat=True)) == ["taken"]


def test_an_import_with_bad_rows_lists_each_by_number_and_imports_nothing(client, world):
    client.force_login(world.operator)
    good = {"image": b64(image_bytes(32, 32)), "question": "What is written?", "answer": "42"}
    rows = [good, {**good, "question": ""}, good, {**good, "image": b64(png_with_header(20_000, 20_000,
                                                                                        rows_of_zeros=False))},
            {**good, "task_type": "presence", "answer": "perhaps"}, good]
    response = upload(client, "mixed.jsonl", jsonl(rows))
    job = run_queued_import()
    assert response.url == f"/benchmarks/sets/imports/{job.pk}/"
    assert job.state == "failed" and job.error_count == 3 and job.rows == 6
    assert [row for row, _ in job.errors] == [2, 4, 5]
    assert not EvalSet.objects.exists() and not EvalItem.objects.exists()
    assert bytes(job.data) == b""  # the file is not kept once the import ends
    page = client.get(f"/benchmarks/sets/imports/{job.pk}/").content.decode()
    assert "3 rows refused; nothing was imported" in page
    assert '<tr data-row="2"><td>2</td><td>question is empty</td></tr>' in page
    assert "a presence question&#x27;s answer must be yes or no" in page


def test_a_thousand_row_import_lands_whole_with_its_progress(client, world):
    client.force_login(world.operator)
    tasks = ["read", "chart", "count", "presence", "description", "reasoning", "long"]
    images = [b64(image_bytes(24 + n, 24, color=(n * 40 % 255, 90, 30))) for n in range(5)]
    rows = [{"image": images[n % 5], "question": f"Question {n}?", "task_type": tasks[n % 7],
             "answers": ["yes" if n % 2 else "no"] if tasks[n % 7] == "presence" else [str(n), f"n{n}"]}
            for n in range(1000)]
    upload(client, "big.jsonl", jsonl(rows), set_name="thousand")
    page = client.get(f"/benchmarks/sets/imports/{EvalImport.objects.get().pk}/").content.decode()
    assert 'http-equiv="refresh"' in page and "queued" in page  # the page polls until it ends
    started = time.monotonic()
    job = run_queued_import()
    took = time.monotonic() - started
    assert job.state == "succeeded", (job.message, job.errors[:3])
    assert (job.rows, job.progress, job.message) == (1000, 1.0, "imported 1000 items")
    eval_set = job.eval_set
    assert eval_set.name == "thousand" and eval_set.source == "imported" and eval_set.file_name == "big.jsonl"
    assert eval_set.items.count() == 1000 and eval_set.items.filter(task_type="presence").count() == 143
    assert list(eval_set.items.order_by("row").values_list("row", flat=True)[:3]) == [1, 2, 3]
    assert took < 60
    page = client.get(f"/benchmarks/sets/imports/{job.pk}/").content.decode()
    assert 'http-equiv="refresh"' not in page and f'href="/benchmarks/sets/{eval_set.pk}/"' in page


def test_image_urls_are_fetched_only_where_outbound_vetting_allows(client, world, settings):
    client.force_login(world.operator)
    with serve_files({"/a.png": (image_bytes(30, 20, "PNG"), "image/png"),
                      "/page": (b"<html></html>", "text/html")}) as base:
        rows = [{"image": f"{base}/a.png", "question": "q", "answer": "a"}]
        eval_set, errors, count = evalsets.evalset_import_read(name="urls", description="", file_name="u.jsonl",
                                                               data=jsonl(rows), task_type="read")
        assert eval_set is None and count == 1 and "a loopback address" in errors[0][1]
        settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]
        rows.append({"image": f"{base}/page", "question": "q", "answer": "a"})
        _, errors, _ = evalsets.evalset_import_read(name="urls", description="", file_name="u.jsonl",
                                                    data=jsonl(rows), task_type="read")
        assert errors == [[2, "image URL returned text/html, not an image"]]
        eval_set, _, _ = evalsets.evalset_import_read(name="urls", description="", file_name="u.jsonl",
                                                      data=jsonl(rows[:1]), task_type="read")
    assert (eval_set.items.get().width, eval_set.items.get().content_type) == (30, "image/png")


def test_a_vlmevalkit_tsv_imports_as_multiple_choice_reasoning(client, world):
    client.force_login(world.operator)
    header = "index\timage\tquestion\tA\tB\tanswer\tcategory"
    line = f"1\t{b64(image_bytes(16, 16))}\tWhich is it?\tcat\tdog\tB\tanimals"
    upload(client, "mmb.tsv", f"{header}\n{line}\n".encode(), set_name="mmb", task_type="reasoning")
    job = run_queued_import()
    item = job.eval_set.items.get()
    assert (item.row, item.task_type, item.answers) == (2, "reasoning", ["B", "dog", "B. dog"])
    assert item.meta["category"] == "animals"


def test_the_management_command_imports_a_big_file_or_lists_its_refused_rows(tmp_path, capsys):
    good = {"image": b64(image_bytes(16, 16)), "question": "q", "answer": "a"}
    path = tmp_path / "set.jsonl"
    path.write_bytes(jsonl([good, {**good, "answer": None}, good]))
    with pytest.raises(CommandError, match="1 rows refused; nothing was imported"):
        call_command("evalset_import", str(path), "--name", "cli", "--task-type", "read")
    assert "row 2: answer (or answers) is missing" in capsys.readouterr().err
    assert not EvalSet.objects.exists()
    path.write_bytes(jsonl([good] * 3))
    call_command("evalset_import", str(path), "--name", "cli", "--task-type", "read")
    assert EvalSet.objects.get(name="cli").items.count() == 3
    assert "3/3 rows" in capsys.readouterr().err  # the progress bar


def test_a_set_shows_thumbnails_and_takes_and_loses_items(client, world):
    client.force_login(world.operator)
    eval_set = EvalSet.objects.create(name="hand", source="imported", file_name="x.jsonl")
    client.post(f"/benchmarks/sets/{eval_set.pk}/items/", {
        "task_type": "read", "question": "What is the total?", "answers": "42.50\n$42.50",
        "image": SimpleUploadedFile("receipt.jpg", image_bytes(600, 900), content_type="image/jpeg")})
    item = eval_set.items.get()
    assert (item.row, item.answers, item.width, item.height) == (1, ["42.50", "$42.50"], 600, 900)
    page = client.get(f"/benchmarks/sets/{eval_set.pk}/").content.decode()
    assert "What is the total?" in page and "42.50 | $42.50" in page
    thumb = client.get(f"/benchmarks/sets/{eval_set.pk}/items/{item.pk}/image/")
    assert thumb["Content-Type"] == "image/jpeg"
    assert max(Image.open(io.BytesIO(thumb.content)).size) <= 160
    client.post(f"/benchmarks/sets/{eval_set.pk}/items/{item.pk}/delete/")
    assert not eval_set.items.exists()


def test_a_profile_chooses_a_set_which_cannot_be_deleted_while_it_is_used(client, world):
    from tests.controlplane.benchmarks.runs import form_data

    client.force_login(world.operator)
    eval_set = evalsets.evalset_generate(name="shapes", task="presence", count=4, seed=1)
    response = client.post("/benchmarks/new/", form_data(world, kind="resolution", eval_set=str(eval_set.pk)))
    assert response.status_code == 302
    profile = eval_set.profiles.get()
    assert 'href="/benchmarks/sets/' in client.get(f"/benchmarks/{profile.pk}/").content.decode()
    client.post(f"/benchmarks/sets/{eval_set.pk}/delete/")
    assert EvalSet.objects.filter(pk=eval_set.pk).exists()
    profile.eval_set = None
    profile.save()
    client.post(f"/benchmarks/sets/{eval_set.pk}/delete/")
    assert not EvalSet.objects.exists() and not EvalItem.objects.exists()


def test_the_api_lists_sets_for_operators(client, world):
    evalsets.evalset_generate(name="reading", task="read", count=3, seed=0)
    client.force_login(world.operator)
    listed = client.get("/api/v1/benchmarks/eval-sets/").json()["results"]
    assert [(s["name"], s["items"], s["task_types"], s["source"]) for s in listed] == \
        [("reading", 3, {"read": 3}, "generated")]
    client.force_login(world.finance)
    assert client.get("/api/v1/benchmarks/eval-sets/").status_code == 403


@pytest.mark.parametrize("who", ["finance", "alice_admin", None])
def test_everyone_but_operators_is_refused_the_set_pages(client, world, who):
    eval_set = evalsets.evalset_generate(name="reading", task="read", count=1, seed=0)
    item = eval_set.items.get()
    job = EvalImport.objects.create(name="x", file_name="x.jsonl", task_type="read")
    if who:
        client.force_login(getattr(world, who))
    for url in ("/benchmarks/sets/", f"/benchmarks/sets/{eval_set.pk}/", f"/benchmarks/sets/imports/{job.pk}/",
                f"/benchmarks/sets/{eval_set.pk}/items/{item.pk}/image/"):
        assert client.get(url).status_code == (403 if who else 302), url
    for url in ("/benchmarks/sets/generate/", "/benchmarks/sets/import/", f"/benchmarks/sets/{eval_set.pk}/delete/",
                f"/benchmarks/sets/{eval_set.pk}/items/{item.pk}/delete/"):
        assert client.post(url, {"name": "y", "task": "read", "count": "1", "seed": "0"}).status_code in (302, 403)
    assert list(EvalSet.objects.values_list("name", flat=True)) == ["reading"] and eval_set.items.count() == 1
    assert EvalImport.objects.count() == 1


def test_the_set_pages_render_for_operators(client, world):
    client.force_login(world.operator)
    eval_set = evalsets.evalset_generate(name="reading", task="read", count=2, seed=0)
    for url in ("/benchmarks/sets/", f"/benchmarks/sets/{eval_set.pk}/", f"/benchmarks/sets/{eval_set.pk}/?page=x"):
        assert client.get(url).status_code == 200, url
    assert 'href="/benchmarks/sets/"' in client.get("/benchmarks/").content.decode()


def test_listing_sets_through_the_api_takes_the_same_queries_for_one_set_or_many(client, world,
                                                                                 django_assert_max_num_queries):
    client.force_login(world.operator)
    evalsets.evalset_generate(name="one", task="read", count=1, seed=0)
    with django_assert_max_num_queries(8) as one:
        client.get("/api/v1/benchmarks/eval-sets/")
    for n in range(5):
        evalsets.evalset_generate(name=f"more {n}", task="count", count=1, seed=n)
    with django_assert_max_num_queries(len(one.captured_queries)):
        assert len(client.get("/api/v1/benchmarks/eval-sets/").json()["results"]) == 6


def test_an_item_added_by_hand_passes_the_same_image_checks_as_an_import(client, world):
    client.force_login(world.operator)
    eval_set = EvalSet.objects.create(name="hand", source="imported", file_name="x.jsonl")
    bomb = png_with_header(20_000, 20_000, rows_of_zeros=False)
    response = client.post(f"/benchmarks/sets/{eval_set.pk}/items/", {
        "task_type": "read", "question": "q", "answers": "a",
        "image": SimpleUploadedFile("bomb.png", bomb, content_type="image/png")}, follow=True)
    assert "image refused" in response.content.decode()
    client.post(f"/benchmarks/sets/{eval_set.pk}/items/", {
        "task_type": "presence", "question": "Is there a cat?", "answers": "perhaps",
        "image": SimpleUploadedFile("a.png", image_bytes(8, 8, "PNG"), content_type="image/png")})
    assert not eval_set.items.exists()


def test_an_import_whose_worker_died_is_shown_as_failed_once_past_its_time_limit(client, world):
    import datetime as dt

    from django.utils import timezone

    client.force_login(world.operator)
    long_ago = timezone.now() - dt.timedelta(seconds=evalsets.IMPORT_TIME_LIMIT_S + 60)
    dead = EvalImport.objects.create(name="x", file_name="x.jsonl", task_type="read", state="running",
                                     started_at=long_ago, data=b"{}")
    alive = EvalImport.objects.create(name="y", file_name="y.jsonl", task_type="read", state="running",
                                      started_at=timezone.now())
    page = client.get(f"/benchmarks/sets/imports/{dead.pk}/").content.decode()
    assert "the worker running it stopped" in page and 'http-equiv="refresh"' not in page
    dead.refresh_from_db()
    alive.refresh_from_db()
    assert (dead.state, bytes(dead.data), alive.state) == ("failed", b"", "running")
