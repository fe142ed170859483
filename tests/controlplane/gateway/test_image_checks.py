"""The checks an image sent as it came gets beside the engine's work run below the priority of
the work on a request's path, and still decide whether the request is answered."""

from __future__ import annotations

import os
import threading

import pytest
from asgiref.sync import async_to_sync

from controlplane.gateway import prepare as preparing
from controlplane.gateway.prepare import RequestInvalid, TierSpec, prepare, validate_body
from controlplane.imaging.policy import Policy
from tests.images import data_url, image_bytes

VISION = TierSpec(id=1, name="vlm", family="qwen2_5_vl", kind="vision", policy=Policy(),
                  processor_options={"min_pixels": 3136, "max_pixels": 1003520}, large_image_threshold=4096,
                  max_output_tokens=1000, price_plan_id=1, max_model_len=8192)


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _prepared(image: bytes):
    body = {"model": "vlm", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}
    validate_body(body)

    async def prepared_and_checked():
        prepared = await prepare(body, VISION, max_image_bytes=10**7)
        assert prepared.checking is not None  # it fits: sent as it came, checked beside the engine
        await prepared.images_checked()
        return prepared

    return async_to_sync(prepared_and_checked)()


def test_an_image_sent_as_it_came_is_checked_below_the_priority_of_the_requests_path(monkeypatch):
    seen = []
    checked = preparing._check

    def check_watched(pending):
        seen.append((_niceness(), threading.current_thread().name))
        return checked(pending)

    monkeypatch.setattr(preparing, "_check", check_watched)
    path = _niceness()
    _prepared(image_bytes(640, 480))
    ((niceness, thread),) = seen
    assert niceness == max(preparing.CHECK_NICE, path) and niceness > 0
    assert thread.startswith("image-check")
    assert _niceness() == path  # the request's own thread keeps its priority


def test_a_corrupt_image_sent_as_it_came_is_still_refused_by_the_check_beside_the_engine():
    whole = image_bytes(640, 480)
    cut = whole[: len(whole) * 2 // 3] + b"\xff\xd9"  # its header intact, its scan cut short
    with pytest.raises(RequestInvalid) as refused:
        _prepared(cut)
    assert refused.value.code == "corrupt_image"
