"""A cascade through the gateway, on the simulator (surer of a picture the more of it it sees):
the cheap attempt at a low pixel cap, escalated to the full cap when it is unsure, cut short or
refusing; both attempts billed as what they were, the quota reserved for both."""

from __future__ import annotations

import json
from decimal import Decimal

import orjson
import pytest

from controlplane.gateway import state
from controlplane.metering.models import UsageEvent
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import Quota, RoutingRule
from tests.controlplane.gateway.calls import error_of, post, post_and_read_stream
from tests.controlplane.gateway.conftest import ingested
from tests.images import data_url, image_bytes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.accounting]

PICTURE = data_url(image_bytes(1000, 1000))  # 1,227 image tokens at the policy's 1 MP; 18 at 12,544 px


def _ask(**extra) -> dict:
    content = [{"type": "text", "text": "what does it say"}, {"type": "image_url", "image_url": {"url": PICTURE}}]
    return {"model": "auto", "max_tokens": 64, "messages": [{"role": "user", "content": content}], **extra}


def _cascade(world, threshold=0.5, **options) -> RoutingRule:
    rule = RoutingRule(tier=world.vision, pixel_cap=12_544, escalate_to=world.vision, threshold=threshold,
                       name="read cheaply", **options)
    rule.full_clean()
    rule.save()
    state.clear_caches()
    return rule


def _events() -> list[UsageEvent]:
    ingested()
    return list(UsageEvent.objects.order_by("created_at", "id"))


def test_an_unsure_cheap_answer_is_escalated_and_both_attempts_are_billed(client, routed, ledger_mode):
    rule = _cascade(routed)
    answer = post(client, routed.alice_key, _ask())
    assert answer.status_code == 200, answer.content
    assert answer["x-cascade"] == "escalated: low_confidence"
    assert answer.json()["choices"][0]["logprobs"] is None  # asked of the engine, not of the client
    first, second = _events()
    assert answer["x-cascade-first-request-id"] == first.request_id and answer["x-request-id"] == second.request_id
    assert (first.image_tokens, second.image_tokens) == (18, 1227)
    assert first.escalation == "low_confidence" and first.confidence < 0.1
    assert second.cascade_of == first.request_id and not second.escalation
    assert first.routed_by == second.routed_by == f"rule 1 (read cheaply), default, #{rule.pk}"
    assert first.status == second.status == "ok" and first.cost > 0 and second.cost > first.cost


def test_a_sure_cheap_answer_is_sent_and_the_strong_tier_is_not_asked(client, routed, ledger_mode):
    _cascade(routed, threshold=0.01)
    answer = post(client, routed.alice_key, _ask())
    assert answer.status_code == 200 and answer["x-cascade"] == "kept"
    (only,) = _events()
    assert only.image_tokens == 18 and only.escalation == "" and 0.01 < only.confidence < 0.1
    assert answer["x-request-id"] == only.request_id and answer.json()["usage"]["prompt_tokens_details"][
        "image_tokens"] == 18


def test_a_client_that_asked_for_logprobs_gets_them(client, routed, ledger_mode):
    _cascade(routed, threshold=0.01)
    answer = post(client, routed.alice_key, _ask(logprobs=True))
    assert answer["x-cascade"] == "kept" and answer.json()["choices"][0]["logprobs"]["content"]


def test_an_answer_cut_short_is_escalated(client, routed, ledger_mode):
    _cascade(routed, threshold=0.01)
    answer = post(client, routed.alice_key, _ask(max_tokens=1))
    assert answer.status_code == 200 and answer["x-cascade"] == "escalated: length"
    first, second = _events()
    assert first.escalation == "length" and second.cascade_of == first.request_id


def test_a_rule_may_keep_an_answer_cut_short(client, routed, ledger_mode):
    _cascade(routed, threshold=0.01, escalate_on_length=False)
    assert post(client, routed.alice_key, _ask(max_tokens=1))["x-cascade"] == "kept"
    assert len(_events()) == 1


def _stream(key, body) -> tuple[list[dict], object]:
    response, raw = post_and_read_stream(key, {**body, "stream": True})
    lines = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]], response


def test_a_streamed_request_gets_the_answer_once_decided(routed, ledger_mode):
    _cascade(routed)
    chunks, response = _stream(routed.alice_key, _ask(stream_options={"include_usage": True}))
    assert response["x-cascade"] == "escalated: low_confidence"
    assert chunks[-1]["usage"]["prompt_tokens_details"]["image_tokens"] == 1227
    first, second = _events()
    assert (first.stream, second.stream) == (False, True)  # the first answer was judged whole


def test_a_kept_answer_is_streamed_as_the_stream_it_would_have_been(routed, ledger_mode):
    _cascade(routed, threshold=0.01)
    chunks, response = _stream(routed.alice_key, _ask(stream_options={"include_usage": True}))
    assert response["x-cascade"] == "kept"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text and chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-1]["choices"] == []
    (only,) = _events()
    assert only.output_tokens == chunks[-1]["usage"]["completion_tokens"]


def test_a_rule_that_does_not_cascade_streams_sends_them_to_the_first_tier(routed, ledger_mode):
    _cascade(routed, cascade_streams=False)
    chunks, response = _stream(routed.alice_key, _ask())
    assert "x-cascade" not in response
    (only,) = _events()
    assert only.image_tokens == 18 and only.stream and only.escalation == "" and only.confidence is None


def test_admission_reserves_for_both_attempts(client, routed, ledger_mode):
    """1,000 tokens a day: the cheap attempt's worst case (its 18 image tokens, its text, 64 out)
    fits, but not beside the strong one's 1,227 image tokens."""
    Quota.objects.create(tenant=routed.alice, period="day", total_tokens=1000)
    rule = _cascade(routed)
    refused = post(client, routed.alice_key, _ask())
    assert refused.status_code == 429 and error_of(refused)["code"] == "insufficient_quota"
    (event,) = _events()
    assert event.http_status == 429 and event.cost == 0 and event.routed_by == f"rule 1 (read cheaply), default, #{rule.pk}"
    rule.escalate_to, rule.threshold = None, None  # no cascade: the cheap attempt alone fits
    rule.save()
    state.clear_caches()
    assert post(client, routed.alice_key, _ask()).status_code == 200


def test_an_escalation_settles_both_attempts_to_what_they_used(client, routed, ledger_mode):
    """A cascade reserves about 1,400 tokens (both attempts' worst cases) and uses about 1,330.
    3,100 a day: a second cascade fits only if the first settled to what it used (held at its
    worst, the two attempts would keep about 2,700), and a third does not fit at all."""
    Quota.objects.create(tenant=routed.alice, period="day", total_tokens=3100)
    _cascade(routed)
    answers = [post(client, routed.alice_key, _ask()) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429], answers[-1].content
    assert [a["x-cascade"] for a in answers[:2]] == ["escalated: low_confidence"] * 2
    used = sum(e.text_tokens + e.image_tokens + e.output_tokens for e in _events())
    assert 2 * 1227 < used < 3100 - 400  # what two cascades used; a third's worst case does not fit beside it


def test_an_image_refused_at_its_first_attempt_is_not_escalated(client, routed, ledger_mode):
    _cascade(routed)
    broken = _ask()
    broken["messages"][0]["content"][1]["image_url"]["url"] = "data:image/png;base64," + "iVBORw0KGgo" + "A" * 40
    answer = post(client, routed.alice_key, json.loads(json.dumps(broken)))
    assert answer.status_code == 400 and "x-cascade" not in answer
    assert len(_events()) == 1


def test_a_budget_holds_room_for_both_attempts(client, routed, ledger_mode):
    """Of a 0.01 USD budget 0.0085 is spent. The cheap attempt's worst case (its image fee of
    0.001, 18 image tokens, 64 out) fits in what is left; beside the strong one's (another
    0.001 and 1,227 image tokens) it does not."""
    spent = UsageRecord(request_id="req-spent", tenant_id=routed.alice.pk, api_key_id=None,
                        tier_id=routed.text.pk, output_tokens=14_167)  # 0.0085 USD at 0.60 a million
    usage_record(record=spent)
    Quota.objects.create(tenant=routed.alice, spend_limit=Decimal("0.01"))
    rule = _cascade(routed)
    refused = post(client, routed.alice_key, _ask())
    assert refused.status_code == 429 and error_of(refused)["code"] == "budget_exceeded"
    rule.escalate_to, rule.threshold = None, None
    rule.save()
    state.clear_caches()
    assert post(client, routed.alice_key, _ask()).status_code == 200


def _cascade_counts(client) -> dict[tuple[str, str], float]:
    from controlplane.fleet.engine_metrics import parse

    series = parse(client.get("/metrics").content.decode())
    return {(labels["rule"], labels["outcome"]): value for labels, value in series.get("vlmcp_gateway_cascades_total", [])}


def test_metrics_count_each_rules_cascades_by_how_the_first_answer_went(client, routed, ledger_mode, settings):
    settings.DEBUG = True  # /metrics without a token
    rule = _cascade(routed)
    label = f"rule 1 (read cheaply), default, #{rule.pk}"
    before = _cascade_counts(client)
    post(client, routed.alice_key, _ask())
    RoutingRule.objects.filter(pk=rule.pk).update(threshold=0.01)
    state.clear_caches()
    post(client, routed.alice_key, _ask())
    post(client, routed.alice_key, _ask(max_tokens=1))
    after = _cascade_counts(client)
    assert {outcome: after.get((label, outcome), 0) - before.get((label, outcome), 0)
            for outcome in ("kept", "low_confidence", "length")} == {"kept": 1, "low_confidence": 1, "length": 1}


@pytest.fixture
def flagship(routed, engines):
    """A second vision tier on the same simulator (serving it as vlm-lite), generating at most 32 tokens."""
    from django.utils import timezone

    from controlplane.fleet.models import EngineInstance, Node
    from tests.factories import PricePlanFactory, VisionTierFactory

    tier = VisionTierFactory(name="vlm-flagship", price_plan=PricePlanFactory(name="flagship"), engine_settings={"max_model_len": 32768, "max_num_seqs": 16,
                                                                    "max_output_tokens": 32})
    EngineInstance.objects.create(tier=tier, node=Node.objects.get(name="local"), port=engines["vlm-lite"],
                                  served_model_name="vlm-lite", actual_state="running", healthy=True,
                                  last_health_at=timezone.now())
    return tier


def test_an_escalation_the_second_tier_refuses_sends_the_first_answer(client, routed, flagship, ledger_mode):
    """The client asks for 64 tokens, more than the second tier generates: its attempt is refused
    with a 400, and the first answer, whole, is the one sent."""
    rule = RoutingRule(tier=routed.vision, pixel_cap=12_544, escalate_to=flagship, threshold=0.5)
    rule.full_clean()
    rule.save()
    state.clear_caches()
    answer = post(client, routed.alice_key, _ask())
    assert answer.status_code == 200, answer.content
    assert answer["x-cascade"] == "not escalated (low_confidence): invalid_request"
    assert answer.json()["model"] == "vlm-lite" and answer.json()["choices"][0]["message"]["content"]
    first, second = _events()
    assert (first.escalation, first.status, second.http_status) == ("low_confidence", "ok", 400)
    assert second.cascade_of == first.request_id and second.tier == flagship and second.cost == 0
    client.force_login(routed.operator)
    page = client.get(f"/requests/{first.request_id}/").content.decode()
    assert "not sent on: the second attempt was not answered, so this answer was sent" in page


def test_an_unpriced_escalation_tier_does_not_hold_up_requests_that_do_not_cascade(routed, flagship, ledger_mode):
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.catalog.models import PriceRate

    rule = _cascade(routed, cascade_streams=False)
    RoutingRule.objects.filter(pk=rule.pk).update(escalate_to=flagship)
    PriceRate.objects.filter(plan=flagship.price_plan).update(effective_from=timezone.now() + timedelta(days=1))
    state.clear_caches()
    chunks, response = _stream(routed.alice_key, _ask())
    assert response.status_code == 200 and "x-cascade" not in response


def test_a_kept_answers_tool_calls_are_streamed_with_their_index():
    from asgiref.sync import async_to_sync

    from controlplane.gateway.cascade import _as_stream

    calls = [{"id": "call_1", "type": "function", "function": {"name": "total", "arguments": "{}"}}]
    answer = {"id": "chatcmpl-1", "created": 1, "model": "vlm-lite", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "logprobs": None,
        "message": {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "sum it"}}]}

    async def read():
        return [chunk async for chunk in _as_stream(answer, include_usage=False)]

    events = [orjson.loads(e[6:]) for e in async_to_sync(read)() if e != b"data: [DONE]\n\n"]
    delta = events[1]["choices"][0]["delta"]
    assert delta["tool_calls"] == [{"index": 0, **calls[0]}] and delta["reasoning_content"] == "sum it"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
