"""The simulator engine as a real process, spoken to over HTTP like vLLM."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from controlplane.textcount import prompt_text_tokens
from tests.images import data_url, image_bytes

ROOT = Path(__file__).resolve().parents[3]
FULL_HD_TOKENS = 1224  # 1920x1080 under max_pixels=1003520: 1222 features + 2 markers


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("simulator") / "engine.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.engines.simulator", "Qwen/Qwen2.5-VL-3B-Instruct",
         "--family", "qwen2_5_vl", "--port", str(port), "--served-model-name", "vlm",
         "--limit-mm-per-prompt", '{"image": 2}',
         "--mm-processor-kwargs", '{"max_pixels": 1003520}'],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"simulator exited: {log_path.read_text()}")
            try:
                if client.get("/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("simulator did not become healthy within 30 s")
            time.sleep(0.05)  # poll interval, bounded by the deadline above
        yield client
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _image_part(width=1920, height=1080, color=(180, 40, 30)):
    url = data_url(image_bytes(width, height, color=color))
    return {"type": "image_url", "image_url": {"url": url}}


def _messages(*images, text="What is in this picture?"):
    return [
        {"role": "system", "content": "You describe images."},
        {"role": "user", "content": [{"type": "text", "text": text}, *images]},
    ]


def _metric(client, name):
    """The value of an unlabelled-by-reason counter in the Prometheus text exposition."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_health_is_200(engine):
    assert engine.get("/health").status_code == 200


def test_version_reports_a_version(engine):
    response = engine.get("/version")
    assert response.status_code == 200
    assert response.json()["version"]


def test_models_lists_the_served_model_name(engine):
    response = engine.get("/v1/models")
    assert response.status_code == 200
    ids = [m["id"] for m in response.json()["data"]]
    assert ids == ["vlm"]


def test_chat_with_a_full_hd_image_counts_its_tokens(engine):
    messages = _messages(_image_part(color=(10, 20, 30)))
    response = engine.post("/v1/chat/completions",
                           json={"model": "vlm", "messages": messages, "max_tokens": 64})
    assert response.status_code == 200
    body = response.json()
    assert body["model"] == "vlm"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt_text_tokens(messages) + FULL_HD_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_text_only_chat_counts_only_text(engine):
    messages = [{"role": "user", "content": "Say hello in three words."}]
    response = engine.post("/v1/chat/completions", json={"model": "vlm", "messages": messages})
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == prompt_text_tokens(messages)


def test_stream_with_include_usage_ends_with_a_usage_chunk_and_done(engine):
    messages = _messages(_image_part(color=(40, 50, 60)))
    payload = {"model": "vlm", "messages": messages, "stream": True, "max_tokens": 20,
               "stream_options": {"include_usage": True}}
    with engine.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]

    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == prompt_text_tokens(messages) + FULL_HD_TOKENS
    content_chunks = [c for c in chunks[:-1] if c["choices"][0]["delta"].get("content")]
    assert usage_chunk["usage"]["completion_tokens"] == len(content_chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in c for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(engine):
    payload = {"model": "vlm", "messages": _messages(), "stream": True, "max_tokens": 5}
    with engine.stream("POST", "/v1/chat/completions", json=payload) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


def test_the_same_image_twice_is_an_encoder_cache_hit(engine):
    image = _image_part(color=(1, 254, 77))  # not sent by any other test
    hits_before = _metric(engine, "vllm:mm_cache_hits_total")
    queries_before = _metric(engine, "vllm:mm_cache_queries_total")

    first = engine.post("/v1/chat/completions", json={"messages": _messages(image)}).json()
    second = engine.post("/v1/chat/completions",
                         json={"messages": _messages(image, text="And now?")}).json()

    assert _metric(engine, "vllm:mm_cache_queries_total") == queries_before + 2
    assert _metric(engine, "vllm:mm_cache_hits_total") == hits_before + 1
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL_HD_TOKENS


def test_more_images_than_the_limit_is_a_400(engine):
    images = [_image_part(64, 64, color=(i, i, i)) for i in range(3)]
    response = engine.post("/v1/chat/completions", json={"messages": _messages(*images)})
    assert response.status_code == 400
    assert "At most 2 image" in response.json()["error"]["message"]


def test_two_images_are_within_the_limit(engine):
    images = [_image_part(color=(i, 9, 9)) for i in (100, 101)]
    messages = _messages(*images)
    response = engine.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == (
        prompt_text_tokens(messages) + 2 * FULL_HD_TOKENS)


def test_max_tokens_is_respected(engine):
    messages = _messages(_image_part(320, 240))
    response = engine.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert len(body["choices"][0]["message"]["content"].split()) == 3


def test_max_completion_tokens_is_respected_when_streaming(engine):
    payload = {"messages": _messages(), "stream": True, "max_completion_tokens": 2,
               "stream_options": {"include_usage": True}}
    with engine.stream("POST", "/v1/chat/completions", json=payload) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"text"'])
def test_malformed_request_body_is_a_400(engine, body):
    response = engine.post("/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"]


@pytest.mark.parametrize("payload, message", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": _messages({"type": "image_url", "image_url": {"url": "https://x.example/a.png"}})},
     "data URL"),
])
def test_invalid_requests_are_a_400(engine, payload, message):
    response = engine.post("/v1/chat/completions", json=payload)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_unknown_path_is_a_404(engine):
    assert engine.get("/v1/embeddings").status_code == 404


def test_metrics_count_prompt_tokens(engine):
    before = _metric(engine, "vllm:prompt_tokens_total")
    messages = [{"role": "user", "content": "count me"}]
    response = engine.post("/v1/chat/completions", json={"messages": messages}).json()
    assert _metric(engine, "vllm:prompt_tokens_total") == before + response["usage"]["prompt_tokens"]
