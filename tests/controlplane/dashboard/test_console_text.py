"""Text on the product pages is text: names quoted in help and labels show as code, never as
the backticks they are written with."""

from __future__ import annotations

import datetime as dt
import html
import re
from decimal import Decimal

import pytest
from django.template import Context, Template
from django.utils import timezone

from controlplane.dashboard.templatetags.console import code_spans

pytestmark = pytest.mark.django_db


def test_quoted_names_in_a_form_show_as_code(client, world):
    client.force_login(world.operator)
    page = client.get(f"/tiers/{world.vision.name}/").content.decode()
    assert "The <code>model</code> tenants ask for" in page and "Default for text (<code>auto</code>)" in page
    assert "`" not in page.split("<main>")[1].split("<script")[0]


def test_quoted_text_is_escaped_before_it_is_marked_up():
    assert code_spans("say `<b>` and `x`") == "say <code>&lt;b&gt;</code> and <code>x</code>"


def test_a_date_on_any_page_is_written_in_iso_with_its_time_zone():
    moment = dt.datetime(2026, 12, 6, 10, 11, tzinfo=dt.UTC)
    shown = Template("{{ moment }} | {{ moment.date }} | {{ moment|date }}").render(Context({"moment": moment}))
    assert shown == "2026-12-06 10:11 UTC | 2026-12-06 | 2026-12-06"  # not "Dec. 6, 2026, 10:11 a.m."


def test_money_is_written_with_its_currency_to_the_cent_or_for_one_request_to_the_micro_unit():
    shown = Template("{% load console %}{{ total|money:'USD' }} | {{ cost|money_each:'EUR' }} | {{ none|money:'USD' }}"
                     " | {{ tiny|money:'USD' }}").render(Context({
                         "total": Decimal("1234.5"), "cost": Decimal("0.001367"), "none": None,
                         "tiny": Decimal("-0.000001")}))
    assert shown == "1,234.50 USD | 0.001367 EUR | — | 0.00 USD"


# A time of day on a page: an ISO date and time, then its zone (a page may leave either out).
_MOMENT = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2}[ T])?(?<![\d:])\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?P<zone> [A-Z]{3,5}\b)?")
# How long ago, allowed only in brackets straight after the moment it counts from.
_AGE = re.compile(r"\b(?:ago|from now)\b")
_AGE_BESIDE_A_MOMENT = re.compile(r"\d{2}:\d{2}(?::\d{2})? [A-Z]{3,5} \([^()]*\b(?:ago|from now)\)")


def _text(page: str) -> str:
    """What a reader sees of a page's main part: no scripts (charts' data), no tags, and no
    engine's log or command, which are theirs, quoted."""
    main = page.split("<main>")[1].split("</main>")[0]
    main = re.sub(r"<(script|style|pre|code)\b.*?</\1>", " ", main, flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", " ", main))


def _dated_world(world):
    """Something dated on every page that shows times: a request, keys, a node, an engine's
    events, benchmark runs, an evaluation set and an alert."""
    from controlplane.alerts.models import Alert, AlertRule
    from controlplane.benchmarks.models import EvalSet
    from controlplane.fleet.models import EngineEvent, EngineInstance, Node
    from controlplane.metering.records import UsageRecord
    from controlplane.metering.services import usage_record
    from controlplane.tenants.models import ApiKey
    from tests.controlplane.benchmarks.runs import finished_run, make_profile

    now = timezone.now()
    usage_record(record=UsageRecord(request_id="dated", tenant_id=world.alice.pk, api_key_id=None,
                                    tier_id=world.text.pk, text_tokens=10, created_at=now))
    ApiKey.objects.filter(tenant=world.alice).update(last_used_at=now, expires_at=now + dt.timedelta(days=30))
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a", last_seen_at=now - dt.timedelta(minutes=3))
    instance = EngineInstance.objects.create(tier=world.vision, node=node, metrics_at=now)
    EngineEvent.objects.create(instance=instance, from_state="starting", to_state="running", reason="healthy")
    profile = make_profile(world.vision)
    for label in ("first", "second"):
        run = finished_run(profile, label, 240.0)
        BenchmarkRun = type(run)
        BenchmarkRun.objects.filter(pk=run.pk).update(started_at=now, finished_at=now)
    EvalSet.objects.create(name="receipts", source="imported", file_name="receipts.jsonl")
    rule = AlertRule.objects.filter(kind="engine_unhealthy").first() or AlertRule.objects.first()
    Alert.objects.create(rule=rule, subject="gpu-a", message="down", value=1)
    return {"run": run, "instance": instance, "profile": profile}


def test_every_time_a_page_shows_has_its_zone_and_an_age_only_beside_it(client, world):
    dated = _dated_world(world)
    client.force_login(world.operator)
    pages = ["/", "/requests/", "/requests/dated/", "/keys/", "/fleet/",
             f"/fleet/{dated['instance'].pk}/", "/operations/", "/alerts/", "/benchmarks/",
             f"/benchmarks/{dated['profile'].pk}/", f"/benchmarks/runs/{dated['run'].pk}/", "/benchmarks/sets/"]
    wrong = {}
    for path in pages:
        response = client.get(path)
        assert response.status_code == 200, path
        text = _text(response.content.decode())
        assert _MOMENT.search(text), f"{path} shows no time: nothing tested"
        unzoned = [m.group(0) for m in _MOMENT.finditer(text) if not (m.group("date") and m.group("zone"))]
        alone = len(_AGE.findall(text)) - len(_AGE_BESIDE_A_MOMENT.findall(text))
        if unzoned or alone:
            wrong[path] = {"without a date or zone": unzoned, "ages without a time": alone}
    assert not wrong, "\n".join(f"{path}: {problems}" for path, problems in wrong.items())
