"""Routing rules: what `auto` means for a request, by its task, its images and what it asks for;
the first rule that holds decides, a key's before its tenant's before the defaults."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ValidationError

from controlplane.gateway import state
from controlplane.gateway.rules import Cascade, Facts, decide, escalation
from controlplane.gateway.tier_choice import needs_sizes, sizing_limits, tier_asked
from controlplane.tenants.models import RoutingRule
from controlplane.tenants.services import api_key_create, api_key_lookup
from tests.controlplane.gateway.calls import image_message
from tests.factories import VisionTierFactory
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db


def _ask(*, images=((800, 600),), task=None, detail=None, text="what is this", **extra) -> dict:
    content = [{"type": "text", "text": text}]
    for width, height in images:
        image = {"url": data_url(image_bytes(width, height))}
        if detail:
            image["detail"] = detail
        content.append({"type": "image_url", "image_url": image})
    body = {"model": "auto", "messages": [{"role": "user", "content": content}], **extra}
    if task:
        body["metadata"] = {"task": task}
    return body


@pytest.fixture
def flagship(world):
    return VisionTierFactory(name="vlm-flagship")


def _rule(tier, **conditions) -> RoutingRule:
    rule = RoutingRule(tier=tier, **conditions)
    rule.full_clean()
    rule.save()
    return rule


def _chosen(key_secret: str, body: dict, headers: dict | None = None):
    state.clear_caches()
    key = async_to_sync(state.key_info)(key_secret)
    tiers = async_to_sync(state.tiers)()
    facts = Facts(body, headers, max_image_bytes=20 << 20)
    if needs_sizes(body["model"], key, facts):
        facts.size_pictures(sizing_limits())
    return tier_asked(body["model"], key, tiers, True, facts)


def test_a_request_no_rule_holds_for_goes_where_auto_went_before(world, flagship):
    _rule(flagship, tasks="receipt")
    choice = _chosen(world.alice_key, _ask(task="person"))
    assert (choice.tier.name, choice.rule) == ("vlm-lite", None)


def test_the_task_is_read_from_the_metadata_or_the_header(world, flagship):
    _rule(flagship, tasks="receipt, invoice")
    assert _chosen(world.alice_key, _ask(task="invoice")).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask(), {"x-task": "receipt"}).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask(task="receipts")).tier.name == "vlm-lite"
    assert _chosen(world.alice_key, _ask(task=" Invoice ")).tier.name == "vlm-flagship"  # in any case


def test_the_number_of_images_bounds_both_ways(world, flagship):
    _rule(flagship, min_images=2, max_images=3)
    counts = {n: _chosen(world.alice_key, _ask(images=[(64, 64)] * n)).tier.name for n in (1, 2, 3, 4)}
    assert counts == {1: "vlm-lite", 2: "vlm-flagship", 3: "vlm-flagship", 4: "vlm-lite"}


def test_source_pixels_are_the_largest_images_read_from_its_header(world, flagship):
    _rule(flagship, min_source_pixels=1_000_000)
    assert _chosen(world.alice_key, _ask(images=[(640, 480), (1000, 1000)])).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask(images=[(640, 480), (999, 1000)])).tier.name == "vlm-lite"


def test_a_picture_given_by_url_has_no_size_so_a_size_condition_does_not_hold(world, flagship):
    _rule(flagship, max_source_pixels=10_000_000)
    body = {"model": "auto", "messages": image_message("https://example.com/cat.jpg")}
    assert _chosen(world.alice_key, body).tier.name == "vlm-lite"
    _rule(flagship, position=2, min_images=1)  # one that does not look at the picture holds
    assert _chosen(world.alice_key, body).tier.name == "vlm-flagship"


def test_image_tokens_are_counted_at_the_rules_tier_as_the_rule_sends_it(world, flagship):
    # 1,000 x 1,000 is 1,296 image tokens at the policy's 1 MP cap; under a cap of 200,704
    # pixels (as at low detail) 256.
    _rule(flagship, pixel_cap=200_704, max_image_tokens=300)
    choice = _chosen(world.alice_key, _ask(images=[(1000, 1000)]))
    assert choice.tier.name == "vlm-flagship" and choice.tier.policy.max_pixels == 200_704
    RoutingRule.objects.update(pixel_cap=None)
    assert _chosen(world.alice_key, _ask(images=[(1000, 1000)])).tier.name == "vlm-lite"


def test_a_low_detail_asked_counts_at_low_detail(world, flagship):
    _rule(flagship, max_image_tokens=300)
    assert _chosen(world.alice_key, _ask(images=[(1000, 1000)], detail="low")).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask(images=[(1000, 1000)], detail="high")).tier.name == "vlm-lite"


def test_a_rules_detail_sends_every_image_at_it_whatever_it_asked(world, flagship):
    _rule(flagship, send_detail="low")
    policy = _chosen(world.alice_key, _ask(detail="high")).tier.policy
    assert policy.max_pixels == policy.low_detail_max_pixels == 200_704


def test_the_detail_condition_holds_when_every_image_asks_it(world, flagship):
    _rule(flagship, detail="low")
    assert _chosen(world.alice_key, _ask(images=[(64, 64)] * 2, detail="low")).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask(images=[(64, 64)])).tier.name == "vlm-lite"  # asked none: auto
    RoutingRule.objects.update(detail="auto")
    assert _chosen(world.alice_key, _ask(images=[(64, 64)])).tier.name == "vlm-flagship"


def test_prompt_tokens_and_max_tokens_bound_it(world, flagship):
    _rule(flagship, min_prompt_tokens=200)
    assert _chosen(world.alice_key, _ask(text="word " * 400)).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask(text="a short one")).tier.name == "vlm-lite"
    RoutingRule.objects.update(min_prompt_tokens=None, min_max_tokens=500)
    assert _chosen(world.alice_key, _ask(max_tokens=800)).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask(max_completion_tokens=800)).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask(max_tokens=100)).tier.name == "vlm-lite"
    # None asked: the tier's own limit (1,024) is what it may generate.
    assert _chosen(world.alice_key, _ask()).tier.name == "vlm-flagship"


def test_the_presence_of_tools(world, flagship):
    _rule(flagship, tools="with")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert _chosen(world.alice_key, _ask(tools=tools)).tier.name == "vlm-flagship"
    assert _chosen(world.alice_key, _ask()).tier.name == "vlm-lite"
    RoutingRule.objects.update(tools="without")
    assert _chosen(world.alice_key, _ask()).tier.name == "vlm-flagship"


def test_a_keys_rules_come_before_its_tenants_before_the_defaults(world, flagship):
    lite = world.vision
    everyone = _rule(flagship, tasks="ocr", name="everyone")
    alices = _rule(lite, tasks="ocr", tenant=world.alice, name="alice's")
    key = api_key_lookup(world.alice_key)
    assert _chosen(world.alice_key, _ask(task="ocr")).rule.label == f"rule 1 (alice's), tenant alice, #{alices.pk}"
    assert _chosen(world.bob_key, _ask(task="ocr")).rule.label == f"rule 1 (everyone), default, #{everyone.pk}"
    _rule(flagship, tasks="ocr", api_key=key, position=9)
    assert _chosen(world.alice_key, _ask(task="ocr")).tier.name == "vlm-flagship"
    other = api_key_create(tenant=world.alice).secret
    assert _chosen(other, _ask(task="ocr")).tier.name == "vlm-lite"


def test_within_a_scope_the_lowest_position_is_read_first(world, flagship):
    _rule(flagship, position=2, min_images=1)
    _rule(world.vision, position=1, min_images=1, pixel_cap=100_000)
    assert _chosen(world.alice_key, _ask()).tier.policy.max_pixels == 100_000


def test_a_default_rule_naming_a_tier_the_key_may_not_use_is_passed_over(world, flagship):
    _rule(flagship, min_images=1)
    world.alice.allowed_tiers.set([world.vision, world.text])
    assert _chosen(world.alice_key, _ask()).tier.name == "vlm-lite"
    assert _chosen(world.bob_key, _ask()).tier.name == "vlm-flagship"


def test_a_tenants_or_keys_rule_naming_a_tier_it_may_not_use_is_refused_when_saved(world, flagship):
    world.alice.allowed_tiers.set([world.vision, world.text])
    with pytest.raises(ValidationError) as refused:
        _rule(flagship, tenant=world.alice)
    assert "this tenant may not use vlm-flagship" in str(refused.value)
    key = api_key_create(tenant=world.bob).api_key
    key.allowed_tiers.set([world.vision])
    with pytest.raises(ValidationError) as refused:
        _rule(world.vision, api_key=key, escalate_to=flagship, threshold=0.5)
    assert "this key may not use vlm-flagship" in str(refused.value)


def test_a_rule_is_checked_before_it_is_saved(world, flagship):
    for conditions, field in (({"min_images": 3, "max_images": 2}, "max_images"),
                              ({"pixel_cap": 2_000_000}, "pixel_cap"),
                              ({"escalate_to": flagship}, "threshold"),
                              ({"escalate_to": flagship, "threshold": 1.5}, "threshold"),
                              ({"threshold": 0.5}, "threshold")):
        with pytest.raises(ValidationError) as refused:
            _rule(world.vision, **conditions)
        assert field in refused.value.message_dict, conditions
    with pytest.raises(ValidationError) as refused:
        _rule(world.vision, escalate_to=world.vision, threshold=0.5)
    assert "a higher cap or detail" in str(refused.value)
    _rule(world.vision, pixel_cap=50_176, escalate_to=world.vision, threshold=0.5)  # the same tier, higher


def test_a_named_model_is_not_routed_by_rules(world, flagship):
    _rule(flagship, min_images=1)
    assert _chosen(world.alice_key, {**_ask(), "model": "vlm-lite"}).tier.name == "vlm-lite"


def test_a_disabled_rule_is_not_read(world, flagship):
    _rule(flagship, min_images=1, enabled=False)
    assert _chosen(world.alice_key, _ask()).tier.name == "vlm-lite"


# -- why a cascade's first answer is escalated -------------------------------------------------

def _answer(content="the total is 42", finish="stop", logprobs=(-0.05, -0.1), refusal=None) -> dict:
    message = {"role": "assistant", "content": content, "refusal": refusal}
    tokens = [{"token": "t", "logprob": value} for value in logprobs or ()]
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": {"content": tokens} if logprobs is not None else None}]}


def test_an_answer_is_escalated_when_its_token_probability_is_below_the_threshold():
    sure = Cascade(to=None, threshold=0.8)
    assert escalation(_answer(logprobs=(-0.05, -0.1)), sure)[0] == ""
    reason, confidence = escalation(_answer(logprobs=(-0.05, -1.0)), sure)
    assert reason == "low_confidence" and confidence == pytest.approx(0.5916, abs=1e-4)  # exp(-0.525)
    # The least token: one unsure token is enough.
    assert escalation(_answer(logprobs=(-0.01, -0.01, -0.3)), Cascade(to=None, threshold=0.8, confidence="min"))[0] \
        == "low_confidence"
    assert escalation(_answer(logprobs=None), sure) == ("no_confidence", None)  # the engine gave none


def test_an_answer_cut_short_or_refusing_is_escalated_when_the_rule_says_so():
    rule = Cascade(to=None, threshold=0.1)
    assert escalation(_answer(finish="length"), rule)[0] == "length"
    assert escalation(_answer(finish="length"), Cascade(to=None, threshold=0.1, on_length=False))[0] == ""
    for refusing in (_answer(content="I'm sorry, I can't help with that."), _answer(refusal="no"),
                     _answer(finish="content_filter")):
        assert escalation(refusing, rule)[0] == "refusal"
    assert escalation(_answer(content="I'm sorry, I can't help."), Cascade(to=None, threshold=0.1,
                                                                            on_refusal=False))[0] == ""
    assert escalation({"choices": []}, rule)[0] == "no_answer"


def test_decide_passes_over_a_text_tier_for_a_request_with_images(world):
    _rule(world.text, min_prompt_tokens=0)
    key = async_to_sync(state.key_info)(world.alice_key)
    tiers = {tier.id: tier for tier in async_to_sync(state.tiers)().values()}
    assert decide(key.rules, Facts(_ask(), max_image_bytes=1 << 20), tiers) is None
    text_only = {"model": "auto", "messages": [{"role": "user", "content": "hello"}]}
    assert decide(key.rules, Facts(text_only, max_image_bytes=1 << 20), tiers).tier.name == "text"


def test_a_picture_whose_header_is_costly_to_read_is_given_up_on_within_its_cpu_time(world, flagship, settings):
    from controlplane.gateway.rules import SizingLimits
    from tests.imaging_corpus import chunky_png

    body = {"model": "auto", "messages": image_message(data_url(chunky_png(), "image/png"))}
    facts = Facts(body, max_image_bytes=64 << 20)
    spent = facts.size_pictures(SizingLimits(cpu_seconds=0.05))
    assert facts.source_sizes() is None and spent < 0.5  # a size condition then does not hold
    _rule(flagship, max_source_pixels=10_000_000)
    settings.GATEWAY_REQUEST_IMAGE_CPU_MS = 50
    assert _chosen(world.alice_key, body).tier.name == "vlm-lite"


def test_a_picture_given_by_url_is_reserved_for_as_large_as_the_tiers_policy_lets_it_be(world):
    from controlplane.gateway.rules import worst_image_tokens

    tier = async_to_sync(state.tiers)()["vlm-lite"]
    by_url = Facts({"model": "auto", "messages": image_message("https://example.com/cat.jpg")}, max_image_bytes=1)
    sized = Facts(_ask(images=[(640, 480)]), max_image_bytes=1 << 20)
    sized.size_pictures(sizing_limits())
    assert worst_image_tokens(by_url, tier) == 1227 > worst_image_tokens(sized, tier)  # a 1 MP square
