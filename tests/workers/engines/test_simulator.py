"""The simulator engine as a real process, spoken to over HTTP like vLLM."""

import contextlib
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest.mock import ANY

import httpx
import pytest

from controlplane.textcount import MESSAGE_OVERHEAD, REPLY_PRIMER, prompt_text_tokens
from tests.images import data_url, image_bytes

ROOT = Path(__file__).resolve().parents[3]
FULL_HD_TOKENS = 1224  # 1920x1080 under max_pixels=1003520: 1222 features + 2 markers


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _running_engine(log_dir, *extra, api_key=None):
    """A simulator process serving "vlm" (Qwen2.5-VL, 2 images) with `extra` flags."""
    port = _free_port()
    log_path = log_dir / f"engine-{port}.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.engines.simulator", "Qwen/Qwen2.5-VL-3B-Instruct",
         "--family", "qwen2_5_vl", "--port", str(port), "--served-model-name", "vlm",
         "--limit-mm-per-prompt", '{"image": 2}',
         "--mm-processor-kwargs", '{"max_pixels": 1003520}', *extra],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=headers)
    client.process = process
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


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with _running_engine(tmp_path_factory.mktemp("simulator")) as client:
        yield client


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


def _question(*images):
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, *images]}]


def _stream_usage(client, messages):
    payload = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    return json.loads(events[-2])["usage"]


def test_usage_has_vllms_shape_counting_an_images_placeholder_tokens_without_its_markers(engine):
    image = _image_part(1280, 720, color=(77, 1, 200))  # 1198 prompt positions: 1196 + 2 markers
    usage = engine.post("/v1/chat/completions", json={"messages": _question(image)}).json()["usage"]
    assert list(usage) == ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                           "completion_tokens_details"]
    assert usage["prompt_tokens"] == prompt_text_tokens(_question()) + 1198
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 0,
                                              "multimodal_tokens": {"image": 1196}}
    assert usage["completion_tokens_details"] is None
    text = engine.post("/v1/chat/completions", json={"messages": _question()}).json()["usage"]
    assert text["prompt_tokens_details"]["multimodal_tokens"] is None


def test_streamed_usage_has_vllms_shape_without_empty_fields(engine):
    assert _stream_usage(engine, _question()) == {
        "prompt_tokens": prompt_text_tokens(_question()), "total_tokens": ANY, "completion_tokens": ANY,
        "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0}}
    image = _stream_usage(engine, _question(_image_part(1280, 720, color=(78, 2, 201))))
    assert list(image) == ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"]
    assert image["prompt_tokens_details"]["multimodal_tokens"] == {"image": 1196}


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


def test_the_same_image_twice_is_a_processor_cache_hit(engine):
    image = _image_part(color=(1, 254, 77))  # not sent by any other test
    hits_before = _metric(engine, "vllm:mm_cache_hits_total")
    queries_before = _metric(engine, "vllm:mm_cache_queries_total")

    first = engine.post("/v1/chat/completions", json={"messages": _messages(image)}).json()
    second = engine.post("/v1/chat/completions",
                         json={"messages": _messages(image, text="And now?")}).json()

    assert _metric(engine, "vllm:mm_cache_queries_total") == queries_before + 2
    assert _metric(engine, "vllm:mm_cache_hits_total") == hits_before + 1
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # As in vLLM, cached_tokens counts prefix-cache hits only; the image cache hit shows above.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


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


def test_ignore_eos_and_min_tokens_set_the_output_length_as_in_vllm(engine):
    messages = _messages()
    natural = engine.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 500}).json()
    assert natural["usage"]["completion_tokens"] < 100  # the reply ends by itself
    forced = engine.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 500,
                                                        "ignore_eos": True}).json()
    assert (forced["usage"]["completion_tokens"], forced["choices"][0]["finish_reason"]) == (500, "length")
    held = engine.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 500,
                                                      "min_tokens": 120}).json()
    assert held["usage"]["completion_tokens"] == 120


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


def test_a_refused_option_is_a_400_naming_its_parameter_as_vllm_does(engine):
    response = engine.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}})
    assert response.status_code == 400
    assert response.json() == {"error": {
        "message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        "type": "BadRequestError", "param": "stream_options", "code": 400}}


def test_unknown_path_is_a_404(engine):
    assert engine.get("/v1/embeddings").status_code == 404


def test_metrics_count_prompt_tokens(engine):
    before = _metric(engine, "vllm:prompt_tokens_total")
    messages = [{"role": "user", "content": "count me"}]
    response = engine.post("/v1/chat/completions", json={"messages": messages}).json()
    assert _metric(engine, "vllm:prompt_tokens_total") == before + response["usage"]["prompt_tokens"]


# -- the scheduler and fault injection, against real processes ----------------------------------

def _wait(check, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)  # poll interval, bounded by the deadline above
    return result


def _success(client, reason):
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no request_success_total for {reason}")


def _user(text):
    return [{"role": "user", "content": text}]


def _timed_chat(client, messages, **body):
    start = time.monotonic()
    response = client.post("/v1/chat/completions", json={"messages": messages, **body})
    assert response.status_code == 200, response.text
    return time.monotonic() - start


def _ttft(client, messages):
    """Seconds from sending a streamed request to its first event (sent with the first token)."""
    start = time.monotonic()
    payload = {"messages": messages, "stream": True, "max_tokens": 4}
    with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        elapsed = time.monotonic() - start
        assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
        for _ in lines:
            pass
    return elapsed


@pytest.fixture(scope="module")
def priority_engine(tmp_path_factory):
    with _running_engine(tmp_path_factory.mktemp("priority"), "--scheduling-policy", "priority",
                         "--max-num-seqs", "1", "--sim-decode-ms-per-token", "25") as client:
        yield client


def test_priority_runs_a_later_high_priority_request_before_earlier_low_ones(priority_engine):
    client, done = priority_engine, {}

    def send(name, priority, max_tokens=8, text=None):
        response = client.post("/v1/chat/completions", json={
            "messages": _user(text or f"{name} priority request"), "priority": priority,
            "max_tokens": max_tokens})
        done[name] = (time.monotonic(), response)

    with ThreadPoolExecutor(5) as pool:
        # A 39-token reply: holds the only slot for ~1 s while the queue forms behind it (four
        # submissions and their /metrics reads must fit in that, on a loaded machine too).
        futures = [pool.submit(send, "low0", 10, 64, "low priority request 0")]
        _wait(lambda: _metric(client, "vllm:num_requests_running") == 1, "low0 to run")
        for n in (1, 2, 3):
            futures.append(pool.submit(send, f"low{n}", 10))
            _wait(lambda n=n: _metric(client, "vllm:num_requests_waiting") == n, f"low{n} to queue")
        futures.append(pool.submit(send, "high", 0))
        assert "low0" not in done  # the queue was really there when "high" came
        for future in futures:
            future.result()

    assert all(response.status_code == 200 for _, response in done.values())
    assert done["low0"][1].json()["usage"]["completion_tokens"] == 39
    assert done["high"][0] < min(done[f"low{n}"][0] for n in (1, 2, 3))
    assert done["low0"][0] < done["high"][0]  # running work is not interrupted


@pytest.fixture(scope="module")
def batching_engine(tmp_path_factory):
    # Shaped like a GPU: a fixed step cost that batching amortises, costly prefill and encoding.
    with _running_engine(tmp_path_factory.mktemp("batching"), "--sim-step-overhead-ms", "12",
                         "--sim-decode-ms-per-token", "0.2", "--sim-prefill-us-per-token", "50",
                         "--sim-encode-us-per-image-token", "60", "--enable-prefix-caching") as client:
        yield client


def test_concurrent_requests_are_batched_into_shared_steps(batching_engine):
    client, n = batching_engine, 8
    single = min(_timed_chat(client, _user(f"batch {i}"), max_tokens=8) for i in range(3))
    start = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda i: _timed_chat(client, _user(f"together {i}"), max_tokens=8), range(n)))
    together = time.monotonic() - start
    # One after the other they would take n times as long; shared steps take a fraction of it
    # (half leaves room for a loaded machine's threads starting late).
    assert together < 0.5 * n * single, (together, single)


def test_a_large_images_prefill_delays_a_concurrent_text_requests_ttft(batching_engine):
    client, text = batching_engine, _user("Only text here, no image at all.")
    alone = sorted(_ttft(client, text) for _ in range(3))[1]
    large = [_messages(_image_part(color=(200, i, 3)), _image_part(color=(201, i, 4)))
             for i in range(3)]  # 2 x 1224 image tokens each, never seen by this engine
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(client.post, "/v1/chat/completions",
                               json={"messages": m, "max_tokens": 4}) for m in large]
        _wait(lambda: _metric(client, "vllm:num_requests_running") >= 3, "the images to prefill")
        beside = _ttft(client, text)
        assert all(f.result().status_code == 200 for f in futures)
    # Five times its TTFT alone at least (and 50 ms). The images' prefill step is ~0.8 s (7,344
    # image tokens at 110 us each), so the text waits for most of it even when the wait above
    # sees the images running late (at 70 us a token, 0.5 s, it once waited only 99 ms on CI).
    assert beside > max(5 * alone, 0.05), (beside, alone)


def test_the_prefix_cache_reports_the_conversation_so_far_as_cached(batching_engine):
    client = batching_engine
    history = [{"role": "system", "content": "Answer in one short sentence. " * 8},
               {"role": "user", "content": "What colour is the sky?"},
               {"role": "assistant", "content": "Blue, mostly."}]
    hits = _metric(client, "vllm:prefix_cache_hits_total")

    def cached(question, **body):
        response = client.post("/v1/chat/completions",
                               json={"messages": [*history, *_user(question)], **body})
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("And at night?") == 0
    # Whole blocks of the history and the next turn's opening (not the reply primer).
    expected = (prompt_text_tokens(history) - REPLY_PRIMER + MESSAGE_OVERHEAD) // 16 * 16
    assert cached("And at dawn?") == expected > 0
    assert _metric(client, "vllm:prefix_cache_hits_total") == hits + expected
    assert cached("And at dusk?", cache_salt="another-tenant") == 0


def test_the_same_image_request_again_is_cached_in_whole_blocks_but_for_its_last_token(batching_engine):
    messages = _question(_image_part(1280, 720, color=(3, 141, 59)))
    first, again = (batching_engine.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8})
                    .json()["usage"] for _ in range(2))
    prompt = first["prompt_tokens"]
    assert prompt % 16  # so that the second one writes no block of its own
    # The first writes all the prompt's full blocks into the cache, the second reads them.
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["prompt_tokens_details"]["created_cache_tokens"] == prompt // 16 * 16
    assert again["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16
    assert again["prompt_tokens_details"]["created_cache_tokens"] == 0


@pytest.fixture(scope="module")
def tiny_kv_engine(tmp_path_factory):
    # 128 tokens = 8 blocks: eight 8-token prompts fill it, and each needs a second block at
    # its ninth token. Alone, a request (8 + at most 40 tokens) fits with room to spare.
    with _running_engine(tmp_path_factory.mktemp("kv"), "--sim-kv-cache-tokens", "128",
                         "--max-num-seqs", "8", "--sim-decode-ms-per-token", "3") as client:
        yield client


def test_a_tiny_kv_cache_preempts_and_every_request_still_completes(tiny_kv_engine):
    client = tiny_kv_engine
    before = _metric(client, "vllm:num_preemptions_total")
    bodies = [{"messages": _user(f"r{i}"), "max_tokens": 40} for i in range(8)]

    def chat(body):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(chat, bodies))
    assert _metric(client, "vllm:num_preemptions_total") > before
    alone = [chat(body) for body in bodies]  # one at a time: nothing is preempted
    for crowded, single in zip(together, alone, strict=True):
        assert crowded["usage"]["prompt_tokens"] == 8
        assert crowded["choices"][0]["message"] == single["choices"][0]["message"]
        assert crowded["choices"][0]["finish_reason"] == single["choices"][0]["finish_reason"]
        assert crowded["usage"] == single["usage"]
    assert _metric(client, "vllm:kv_cache_usage_perc") == 0
    assert _metric(client, "vllm:num_requests_running") == 0


@pytest.fixture(scope="module")
def fault_engine(tmp_path_factory):
    with _running_engine(tmp_path_factory.mktemp("faults"), "--api-key", "drill-key",
                         api_key="drill-key") as client:
        yield client


@pytest.fixture
def faulty(fault_engine):
    yield fault_engine
    assert fault_engine.post("/sim/fault", json={"mode": "none"}).json()["mode"] == "none"


def _fault(client, **body):
    response = client.post("/sim/fault", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["mode"] == body["mode"]


def test_setting_a_fault_needs_the_api_key(faulty):
    url = f"{faulty.base_url}/sim/fault"
    assert httpx.post(url, json={"mode": "hang"}).status_code == 401
    assert httpx.post(url, json={"mode": "hang"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert faulty.get("/sim/fault").json()["mode"] == "none"


@pytest.mark.parametrize("body", [{"mode": "explode"}, {"mode": "slow", "factor": 0},
                                  {"mode": "error_rate", "rate": 2}, [1]])
def test_an_invalid_fault_is_a_400(faulty, body):
    response = faulty.post("/sim/fault", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"]


def test_error_rate_one_answers_500_with_an_openai_error_body(faulty):
    _fault(faulty, mode="error_rate", rate=1.0)
    response = faulty.post("/v1/chat/completions", json={"messages": _user("fail me")})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["message"] and error["code"] == 500 and error["type"]
    _fault(faulty, mode="none")
    assert faulty.post("/v1/chat/completions", json={"messages": _user("fine")}).status_code == 200


def test_slow_stretches_every_step(faulty):
    base = sorted(_timed_chat(faulty, _user(f"pace {i}"), max_tokens=8) for i in range(3))[1]
    _fault(faulty, mode="slow", factor=60)
    slow = _timed_chat(faulty, _user("pace 9"), max_tokens=8)
    assert slow > 3 * base and slow - base > 0.1, (slow, base)


def test_hang_keeps_health_200_while_completions_time_out(faulty):
    aborted = _success(faulty, "abort")
    _fault(faulty, mode="hang")
    tokens = _metric(faulty, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        faulty.post("/v1/chat/completions", json={"messages": _user("stuck")}, timeout=0.5)
    assert faulty.get("/health").status_code == 200
    assert _metric(faulty, "vllm:generation_tokens_total") == tokens  # nothing moves
    _fault(faulty, mode="none")  # the loop resumes: the abandoned request is aborted
    _wait(lambda: _success(faulty, "abort") == aborted + 1, "the timed-out request's abort")
    _timed_chat(faulty, _user("unstuck"))


def test_a_client_leaving_a_stream_aborts_its_sequence_and_frees_its_kv(faulty):
    aborted = _success(faulty, "abort")
    _fault(faulty, mode="slow", factor=50)
    payload = {"messages": _user("leave early"), "stream": True, "max_tokens": 40}
    with faulty.stream("POST", "/v1/chat/completions", json=payload) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    _wait(lambda: _success(faulty, "abort") == aborted + 1, "the abort")
    assert _metric(faulty, "vllm:num_requests_running") == 0
    assert _metric(faulty, "vllm:kv_cache_usage_perc") == 0


def test_crash_fault_exits_the_process_with_a_non_zero_code(tmp_path):
    with _running_engine(tmp_path) as client:
        with contextlib.suppress(httpx.TransportError):
            client.post("/sim/fault", json={"mode": "crash"})
        assert client.process.wait(timeout=10) != 0


def test_crash_fault_from_the_command_line_exits_at_start():
    process = subprocess.run(
        [sys.executable, "-m", "workers.engines.simulator", "m", "--family", "qwen2",
         "--port", str(_free_port()), "--sim-fault", "crash"],
        cwd=ROOT, capture_output=True, timeout=30)
    assert process.returncode != 0
    assert b"crash" in process.stderr
