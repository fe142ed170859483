"""Whatever a client sends, the gateway answers with a clear 4xx (or 503 with no engine), never a 500."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": json_values}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": json_values}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.fixed_dictionaries({"url": st.text(max_size=40),
                                                               "detail": json_values})}),
    json_values,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
    optional={"content": st.text(max_size=30) | st.lists(part, max_size=3) | json_values},
)
body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["auto", "text", "vlm-lite", "missing"]) | json_values,
        "messages": st.lists(message, max_size=3) | json_values,
        "stream": json_values,
        "stream_options": json_values,
        "max_tokens": json_values,
        "max_completion_tokens": json_values,
        "n": json_values,
        "cache_salt": json_values,
    },
)


@pytest.mark.django_db
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=body)
def test_no_request_body_makes_the_gateway_fail(client, world, payload):
    response = client.post("/v1/chat/completions", data=json.dumps(payload), content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert response.status_code in (400, 403, 404, 413, 503), response.content
    error = response.json()["error"]
    assert error["message"] and error["type"]


# A small set of values of every JSON type: each field of an otherwise valid request is
# swapped for one of them, which reaches far more code than random JSON does.
confusing = st.sampled_from([None, True, False, 0, 1, -1, 2, 10**9, 1.5, "", "x", "auto", [], [1],
                             {}, {"a": 1}, {"include_usage": True}, {"include_usage": "yes"},
                             {"url": "x"}, {"url": 5}])
content_part = st.sampled_from([
    {"type": "text", "text": "hi"}, {"type": "text", "text": 5}, {"type": "text"},
    {"type": "image_url"}, {"type": "image_url", "image_url": None}, {"type": "image_url", "image_url": "x"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "huge"}},
    {"type": "image_url", "image_url": {"url": "data:;base64,AAAA"}}, {"type": "input_image"},
    {"type": "mystery"}, "text", 5, None, {"image_url": {"url": "http://127.0.0.1/"}},
    {"uuid": "another-tenants-image"}, {"type": "video_url", "video_url": {"url": "x"}},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}, "uuid": "x"},
])
near_valid = st.fixed_dictionaries(
    {"model": st.sampled_from(["auto", "text", "vlm-lite"]),
     "messages": st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["user", "system"]) | confusing},
         optional={"content": st.text(max_size=10) | st.lists(content_part, max_size=3) | confusing}),
         min_size=1, max_size=2)},
    optional={key: confusing for key in (
        "stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "cache_salt",
        "temperature", "priority", "user", "mm_processor_kwargs", "chat_template")},
)


@pytest.mark.django_db
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=near_valid)
@example(payload={"model": "text", "messages": [{"role": "user", "content": "x"}], "stream": True,
                  "stream_options": "x"})
def test_no_almost_valid_body_makes_the_gateway_fail(client, world, payload):
    response = client.post("/v1/chat/completions", data=json.dumps(payload), content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert response.status_code in (400, 503), response.content
