"""/v1 checks the key and the declared length before reading a body, and a body that does
not arrive in time is refused: nobody without a key makes the gateway buffer or wait."""

from __future__ import annotations

import pytest

from tests.controlplane.gateway.calls import front_call as _call

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(world):
    big = [b"x" * 1_000_000] * 64
    for headers in ({}, {"authorization": "Bearer sk-not-a-key"}):
        response, read = _call({**headers, "content-length": str(64_000_000)}, big)
        assert response["status"] == 401 and read == 0


def test_a_body_declared_past_the_limit_is_refused_unread(world, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 1_000_000
    response, read = _call({"authorization": f"Bearer {world.alice_key}", "content-length": "1000001"},
                           [b"x" * 1_000_001])
    assert (response["status"], response["error"]["code"], read) == (413, "request_too_large", 0)


def test_a_body_that_does_not_arrive_in_time_is_a_408(world, settings):
    settings.GATEWAY_BODY_TIMEOUT_S = 1
    response, read = _call({"authorization": f"Bearer {world.alice_key}", "content-length": "5000"},
                           [b'{"model":'], stall=True)
    assert (response["status"], response["error"]["code"]) == (408, "request_timeout")
