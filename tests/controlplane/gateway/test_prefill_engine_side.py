"""Image prefill slots as an engine sees them: no more image requests in prefill at once than
the tier's slots, text never held back by them, and a slot given back with the first token
(the next image prefills while the one before still decodes)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from asgiref.sync import async_to_sync

from tests.engines import answer, raw_engine
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db(transaction=True)
PREFILL_S, DECODE_S = 0.3, 0.6


class Engine:
    """An engine that takes PREFILL_S before its first token and DECODE_S after it, and keeps
    a log of what it had in prefill."""

    def __init__(self):
        self.prefilling: dict[str, int] = {"image": 0, "text": 0}
        self.most = {"image": 0, "both": 0}
        self.log: list[tuple[float, str, str]] = []  # (when, event, kind)

    async def serve(self, reader, writer):
        data = b""
        while b"\r\n\r\n" not in data:
            data += await reader.read(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                     .split(b":")[1])
        while len(body) < length:
            body += await reader.read(65536)
        kind = "image" if b'"image_url"' in body else "text"
        self.prefilling[kind] += 1
        self.most["image"] = max(self.most["image"], self.prefilling["image"])
        self.most["both"] = max(self.most["both"], self.prefilling["image"] + self.prefilling["text"])
        self.log.append((time.monotonic(), "prefill", kind))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(PREFILL_S)
        self.prefilling[kind] -= 1
        self.log.append((time.monotonic(), "first token", kind))
        self._send(writer, {"choices": [{"index": 0, "delta": {"content": "a"}}]})
        await writer.drain()
        await asyncio.sleep(DECODE_S)
        self._send(writer, {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]})
        self._send(writer, {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})
        line = b"data: [DONE]\n\n"
        writer.write(hex(len(line))[2:].encode() + b"\r\n" + line + b"\r\n0\r\n\r\n")
        await writer.drain()
        self.log.append((time.monotonic(), "done", kind))
        writer.close()

    @staticmethod
    def _send(writer, chunk):
        line = b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", **chunk}).encode() + b"\n\n"
        writer.write(hex(len(line))[2:].encode() + b"\r\n" + line + b"\r\n")


def _body(images: bool) -> bytes:
    content = [{"type": "text", "text": "what is this"}]
    if images:
        content.append({"type": "image_url", "image_url": {"url": data_url(image_bytes(64, 64, "PNG"), "image/png")}})
    return json.dumps({"model": "vlm-lite", "max_tokens": 2, "stream": True,
                       "messages": [{"role": "user", "content": content}]}).encode()


def test_an_engine_prefills_no_more_image_requests_than_its_slots_and_text_is_not_held(world):
    world.vision.engine_settings = {**world.vision.engine_settings, "image_prefill_slots": 1}
    world.vision.save()
    engine = Engine()

    @async_to_sync
    async def run():
        server = await raw_engine(world, engine.serve)
        images = [asyncio.ensure_future(answer(world, _body(True))) for _ in range(4)]
        await asyncio.sleep(0.05)
        texts = [asyncio.ensure_future(answer(world, _body(False))) for _ in range(2)]
        answers = await asyncio.gather(*images, *texts)
        server.close()
        return answers

    answers = run()
    assert [status for status, _ in answers] == [200] * 6 and all(b"[DONE]" in text for _, text in answers)
    assert engine.most["image"] == 1  # never two image prefills at once
    assert engine.most["both"] >= 2  # text went in beside an image's prefill
    # Each image after the first started its prefill while the one before it still decoded.
    events = sorted(engine.log)
    image_starts = [when for when, event, kind in events if event == "prefill" and kind == "image"]
    image_ends = [when for when, event, kind in events if event == "done" and kind == "image"]
    assert all(start < end for start, end in zip(image_starts[1:], image_ends[:-1], strict=True))
