"""Reading an operator's evaluation file: JSONL and VLMEvalKit's TSV, alone or zipped with
their images; each bad row refused with its number and why, images checked as the gateway
checks them."""

from __future__ import annotations

import base64
import io
import json
import zipfile

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane.benchmarks import evalfiles
from tests.images import data_url, image_bytes
from tests.imaging_corpus import png_with_header


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def jsonl(*rows) -> bytes:
    return "\n".join(json.dumps(row) for row in rows).encode()


def read(data: bytes, name: str, task="reasoning", **kwargs):
    total, rows = evalfiles.read_rows(data, name, default_task=task, **kwargs)
    return total, list(rows)


def test_jsonl_rows_take_base64_data_urls_and_their_own_task_type():
    total, rows = read(jsonl(
        {"image": b64(image_bytes(64, 48)), "question": "What is written?", "answer": "42", "task_type": "read"},
        {"image": data_url(image_bytes(32, 32, "PNG"), "image/png"), "question": "Is there a dog?",
         "answers": ["No"], "task_type": "presence"},
        {"image": b64(image_bytes(20, 20)), "question": "How many?", "answer": 3},
    ), "set.jsonl")
    assert total == 3
    first, second, third = rows
    assert (first.row, first.task_type, first.answers, first.content_type, first.width, first.height) == \
        (1, "read", ["42"], "image/jpeg", 64, 48)
    assert (second.task_type, second.answers, second.content_type) == ("presence", ["no"], "image/png")
    assert (third.task_type, third.answers) == ("reasoning", ["3"])  # the file's default task type


def test_each_bad_row_is_refused_with_its_number_and_reason():
    good = b64(image_bytes(16, 16))
    _, rows = read(b"\n".join([
        json.dumps({"image": good, "question": "ok?", "answer": "yes"}).encode(),
        b"{not json",
        json.dumps({"image": good, "answer": "x"}).encode(),
        json.dumps({"image": good, "question": "q", "answers": []}).encode(),
        json.dumps({"image": good, "question": "q", "answer": "x", "task_type": "poetry"}).encode(),
        json.dumps({"image": "bm90IGFuIGltYWdl", "question": "q", "answer": "x"}).encode(),
        json.dumps({"image": "photos/cat.jpg", "question": "q", "answer": "x"}).encode(),
        json.dumps({"image": good, "question": "q", "answer": "maybe", "task_type": "presence"}).encode(),
        json.dumps({"image": b64(png_with_header(20_000, 20_000, rows_of_zeros=False)), "question": "q",
                    "answer": "x"}).encode(),
        json.dumps({"image": "https://example.com/a.png", "question": "q", "answer": "x"}).encode(),
    ]), "bad.jsonl")
    refused = {r.row: r.reason for r in rows if isinstance(r, evalfiles.RowError)}
    assert sorted(refused) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert refused[2].startswith("not JSON")
    assert refused[3] == "question must be text"
    assert refused[4] == "answers is empty"
    assert "task_type 'poetry' is not one of" in refused[5]
    assert refused[6].startswith("image refused")
    assert refused[7] == "image 'photos/cat.jpg' names a file, but no zip came with the images"
    assert refused[8] == "a presence question's answer must be yes or no"
    assert "more pixels" in refused[9] or "pixels" in refused[9]  # a bomb, refused from its header
    assert refused[10] == "image URLs are not fetched here"


def test_a_zip_brings_the_images_its_rows_name():
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data/set.jsonl", jsonl({"image": "img/a.png", "question": "q", "answer": "a"},
                                           {"image": "img/missing.png", "question": "q", "answer": "b"}))
        z.writestr("data/img/a.png", image_bytes(40, 30, "PNG"))
    _, rows = read(archive.getvalue(), "upload.zip")
    assert rows[0].width == 40 and rows[0].content_type == "image/png"
    assert rows[1] == evalfiles.RowError(2, "image 'img/missing.png' is no file of the zip")


def test_a_zip_must_hold_one_table():
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("a.png", image_bytes(4, 4, "PNG"))
    with pytest.raises(evalfiles.FileRefused, match="one .jsonl or .tsv"):
        read(archive.getvalue(), "x.zip")


def tsv(header, *rows) -> bytes:
    return "\n".join("\t".join(cells) for cells in [header, *rows]).encode()


def test_vlmevalkit_tsv_rows_with_choices_and_shared_images():
    image = b64(image_bytes(50, 40))
    total, rows = read(tsv(["index", "image", "question", "hint", "A", "B", "C", "answer", "category"],
                           ["7", image, "What colour is it?", "Look closely", "red", "green", "blue", "A", "colour"],
                           ["8", "7", "What is shown?", "", "a cat", "a dog", "", "b", "animal"]), "mmb.tsv")
    assert total == 2
    first, second = rows
    assert first.row == 2 and first.answers == ["A", "red", "A. red"]
    assert first.question.splitlines() == ["Hint: Look closely", "What colour is it?", "A. red", "B. green",
                                           "C. blue", "Answer with the letter of the right choice."]
    assert first.meta == {"index": "7", "category": "colour", "choices": {"A": "red", "B": "green", "C": "blue"}}
    assert second.data == first.data and second.answers == ["B", "a dog", "B. a dog"]  # row 8 shares row 7's image


def test_tsv_rows_are_refused_by_their_spreadsheet_row():
    image = b64(image_bytes(8, 8))
    _, rows = read(tsv(["index", "image", "question", "A", "B", "answer"],
                       ["1", image, "q", "x", "y", "C"], ["2", image, "", "x", "y", "A"]), "t.tsv")
    assert rows == [evalfiles.RowError(2, "answer 'C' is not one of the choices A, B"),
                    evalfiles.RowError(3, "question is empty")]


def test_a_tsv_without_vlmevalkits_columns_is_refused_whole():
    with pytest.raises(evalfiles.FileRefused, match="no column answer, image"):
        read(tsv(["index", "question"], ["1", "q"]), "t.tsv")


def test_images_are_checked_as_the_gateway_checks_them():
    with pytest.raises(evalfiles.RowRefused, match="image refused"):
        evalfiles.checked_image(image_bytes(64, 64)[:200])  # truncated
    with pytest.raises(evalfiles.RowRefused, match="not allowed"):
        evalfiles.checked_image(image_bytes(8, 8, "GIF"))
    polyglot = image_bytes(32, 32, "PNG") + b"<script>alert(1)</script>"
    with pytest.raises(evalfiles.RowRefused, match="image refused"):
        evalfiles.checked_image(polyglot)
    assert evalfiles.checked_image(image_bytes(30, 20, "WEBP")) == ("image/webp", 30, 20)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                     max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.dictionaries(st.sampled_from(["image", "question", "answer", "answers", "task_type",
                                                      "category"]), json_values), max_size=4))
@example(rows=[{"question": "q", "answer": "a", "task_type": ["read"]}, {"question": "q", "answers": {"a": 1}}])
def test_any_jsonl_row_is_an_item_or_a_refusal_never_a_crash(rows):
    _, read_back = read(jsonl(*rows) or b"{}", "fuzz.jsonl")
    assert all(isinstance(r, evalfiles.RowError) for r in read_back)  # none has an image


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300))
def test_any_tsv_text_is_rows_or_a_refusal_of_the_file(text):
    try:
        read(("index\timage\tquestion\tanswer\tA\tB\n" + text).encode(), "fuzz.tsv")
    except evalfiles.FileRefused:
        pass
