"""The usage page: what its charts and tables say for the rollups behind them, and who sees what."""

from __future__ import annotations

import csv
import datetime as dt
import html
import io
import json
import re
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.catalog.services import resolution_curve
from controlplane.imaging.policy import Policy, normalise
from controlplane.metering.models import DailyUsage, HourlyUsage, UsageEvent, UsageImage
from controlplane.metering.records import UsageRecord
from controlplane.metering.rollups import rollup_daily, rollup_hourly
from controlplane.metering.services import usage_record
from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import api_key_create
from tests.factories import ResolutionPolicyFactory, TenantFactory, VisionTierFactory
from tests.images import image_bytes

pytestmark = pytest.mark.django_db

_NEW_PLOT = re.compile(r'Plotly\.newPlot\(\s*"([^"]+)",\s*')


def _figures(page: str) -> dict[str, tuple[list, dict]]:
    """Each chart on the page by its id: (traces, layout), as embedded for Plotly."""
    decoder, figures = json.JSONDecoder(), {}
    for match in _NEW_PLOT.finditer(page):
        data, end = decoder.raw_decode(page, match.end())
        layout, _ = decoder.raw_decode(page, re.compile(r",\s*").match(page, end).end())
        figures[match.group(1)] = (data, layout)
    return figures


def _traces(figure) -> dict[str, list]:
    return {trace["name"]: trace["y"] for trace in figure[0]}


def _title(figure) -> str:
    return figure[1]["title"]["text"]


def _today():
    return timezone.now().astimezone(dt.UTC).date()


def _daily(tenant, tier, days_ago=0, **totals):
    return DailyUsage.objects.create(day=_today() - dt.timedelta(days=days_ago), tenant=tenant, tier=tier,
                                     **{"requests": 1, **totals})


def _page(client, user, **params):
    client.force_login(user)
    response = client.get("/usage/", params)
    assert response.status_code == 200
    return response.content.decode()


def _zeros_but(length, **at):
    """A series of `length` slots, oldest first, zero but where `at` says (slot counted back
    from the last: last=..., back_1=...)."""
    values = [0] * length
    for name, value in at.items():
        values[-1 - (0 if name == "last" else int(name.split("_")[1]))] = value
    return values


def test_image_tokens_and_cost_per_day_are_split_per_tier_and_per_tenant(client, world):
    _daily(world.alice, world.vision, image_tokens=1000, cost=Decimal("0.5"))
    _daily(world.alice, world.text, text_tokens=900, cost=Decimal("0.2"))
    _daily(world.charlie, world.vision, days_ago=1, image_tokens=3000, cost=Decimal("1.25"))

    figures = _figures(_page(client, world.operator))

    tokens = figures["image-tokens-chart"]
    assert _title(tokens) == "Image tokens per day"
    assert tokens[0][0]["x"][-1] == _today().isoformat() and len(tokens[0][0]["x"]) == 30
    # the text tier has no image tokens, so no image-token bars
    assert _traces(tokens) == {"vlm-lite": _zeros_but(30, back_1=3000, last=1000)}
    assert _traces(figures["cost-chart"]) == {"text": _zeros_but(30, last=0.2),
                                              "vlm-lite": _zeros_but(30, back_1=1.25, last=0.5)}
    assert _traces(figures["image-tokens-by-tenant-chart"]) == {"alice": _zeros_but(30, last=1000),
                                                               "charlie": _zeros_but(30, back_1=3000)}
    assert _traces(figures["cost-by-tenant-chart"]) == {"alice": _zeros_but(30, last=0.7),
                                                       "charlie": _zeros_but(30, back_1=1.25)}


def test_the_periods_read_hourly_rollups_for_a_day_and_daily_ones_for_30_or_90_days(client, world):
    now = timezone.now().astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)
    for hours_ago, tokens in ((0, 111), (5, 222), (30, 999)):
        HourlyUsage.objects.create(hour=now - dt.timedelta(hours=hours_ago), tenant=world.alice, tier=world.vision,
                                   requests=1, image_tokens=tokens)
    _daily(world.alice, world.vision, image_tokens=5000)
    _daily(world.alice, world.vision, days_ago=60, image_tokens=7000)

    hourly = _figures(_page(client, world.operator, period="24h"))["image-tokens-chart"]
    assert _title(hourly) == "Image tokens per hour"
    assert hourly[0][0]["x"][-1] == now.strftime("%Y-%m-%d %H:00") and len(hourly[0][0]["x"]) == 24
    assert _traces(hourly) == {"vlm-lite": _zeros_but(24, last=111, back_5=222)}  # 30 hours ago is out

    assert _traces(_figures(_page(client, world.operator))["image-tokens-chart"]) == {
        "vlm-lite": _zeros_but(30, last=5000)}
    assert _traces(_figures(_page(client, world.operator, period="90d"))["image-tokens-chart"]) == {
        "vlm-lite": _zeros_but(90, last=5000, back_60=7000)}


def test_staff_narrow_the_page_to_one_tenant_and_one_tier(client, world):
    _daily(world.alice, world.vision, image_tokens=1000, cost=Decimal("0.5"))
    _daily(world.alice, world.text, cost=Decimal("0.2"))
    _daily(world.charlie, world.vision, image_tokens=3000, cost=Decimal("1.25"))

    page = _page(client, world.finance, tenant="alice", tier="vlm-lite")
    figures = _figures(page)
    assert "Usage, last 30 days · alice · vlm-lite" in page
    assert _traces(figures["cost-chart"]) == {"vlm-lite": _zeros_but(30, last=0.5)}
    assert "cost-by-tenant-chart" not in figures  # one tenant: nothing to split
    assert '<option value="alice" selected>' in page


def test_a_tenant_admin_sees_only_their_own_tenant_whatever_they_ask(client, world):
    _daily(world.alice, world.vision, image_tokens=777_001, cost=Decimal("7.77"), cache_savings=Decimal("0.77"))
    _daily(world.charlie, world.vision, image_tokens=333_002, cost=Decimal("3.33"), cache_savings=Decimal("0.33"))

    for params in ({}, {"tenant": "charlie"}):
        page = _page(client, world.charlie_admin, **params)
        figures = _figures(page)
        assert _traces(figures["image-tokens-chart"]) == {"vlm-lite": _zeros_but(30, last=333_002)}
        assert _traces(figures["cost-chart"]) == {"vlm-lite": _zeros_but(30, last=3.33)}
        assert "image-tokens-by-tenant-chart" not in figures
        assert "777001" not in page and "alice" not in page
        assert 'name="tenant"' not in page
        assert "0.33 USD in all" in _title(figures["cache-savings-chart"])


def test_savings_from_cached_images_are_drawn_over_time_with_their_total(client, world):
    _daily(world.alice, world.vision, image_tokens=4000, cached_image_tokens=2448, cache_savings=Decimal("0.367"))
    _daily(world.bob, world.vision, days_ago=3, image_tokens=4000, cached_image_tokens=1224,
           cache_savings=Decimal("0.184"))

    figure = _figures(_page(client, world.operator))["cache-savings-chart"]

    assert _title(figure) == "Saved by cached images: 0.55 USD in all"  # a total: to the cent
    assert _traces(figure) == {"vlm-lite saved": _zeros_but(30, last=0.367, back_3=0.184),
                               "cached image tokens": _zeros_but(30, last=2448, back_3=1224)}


def _request(request_id, tenant, tier, when, images, status="ok"):
    picture = normalise(image_bytes(64, 64), Policy())
    return usage_record(record=UsageRecord(
        request_id=request_id, tenant_id=tenant.pk, api_key_id=None, tier_id=tier.pk, status=status,
        http_status=200 if status == "ok" else 502,
        images=[(picture, tokens, cached) for tokens, cached in images],
        image_tokens=sum(tokens for tokens, _ in images),
        cached_image_tokens=sum(tokens for tokens, cached in images if cached),
        text_tokens=20, output_tokens=5, created_at=when))


def _roll_up():
    UsageEvent.objects.update(recorded_at=timezone.now() - dt.timedelta(minutes=10))
    rollup_hourly(now=timezone.now())
    rollup_daily(now=timezone.now())


def test_the_distribution_of_cost_per_image_comes_from_the_rollup(client, world):
    now = timezone.now()
    # 0.30 per million image tokens, half off when cached, plus 0.001 per image:
    # 0.001367, 0.001184 and 0.007
    _request("a-1", world.alice, world.vision, now, [(1224, False), (1224, True)])
    _request("a-2", world.alice, world.vision, now - dt.timedelta(days=2), [(20000, False)])
    _request("c-1", world.charlie, world.vision, now, [(1224, False)] * 4)
    _request("a-failed", world.alice, world.vision, now, [(1224, False)], status="error")
    _roll_up()

    figure = _figures(_page(client, world.operator))["cost-per-image-chart"]
    assert figure[0][0]["x"] == ["0.001–0.0015", "0.0015–0.002", "0.002–0.003", "0.003–0.005",
                                 "0.005–0.007", "0.007–0.01"]
    assert _traces(figure) == {"vlm-lite": [6, 0, 0, 0, 0, 1]}
    assert figure[0][0]["customdata"][0] == pytest.approx(0.001367 * 5 + 0.001184)
    # (5 x 0.001367 + 0.001184 + 0.007) / 7
    assert _title(figure) == f"Cost per image since {_today() - dt.timedelta(days=29)}: 7 images, 0.002146 USD each on average"

    charlie = _figures(_page(client, world.charlie_admin))["cost-per-image-chart"]
    assert _traces(charlie) == {"vlm-lite": [4]}
    assert _title(charlie).endswith(": 4 images, 0.001367 USD each on average")


def test_each_vision_tiers_resolution_curve_is_drawn_for_everyone(client, world):
    detailed = ResolutionPolicyFactory(name="detailed", max_pixels=3_211_264)
    flagship = VisionTierFactory(name="vlm-flagship", resolution_policy=detailed)

    for user in (world.operator, world.alice_admin):
        page = _page(client, user)
        figure = _figures(page)["tier-resolution-curves"]
        assert _traces(figure) == {"vlm-flagship": [t for _, t in resolution_curve(flagship)],
                                   "vlm-lite": [t for _, t in resolution_curve(world.vision)]}
        # the larger cap keeps growing where the lite tier's policy has stopped
        assert _traces(figure)["vlm-flagship"][-1] > _traces(figure)["vlm-lite"][-1]
    assert 'href="/policies/"' in _page(client, world.operator)
    assert 'href="/policies/"' not in _page(client, world.alice_admin)  # closed to tenants

    one = _figures(_page(client, world.operator, tier="vlm-flagship"))["tier-resolution-curves"]
    assert list(_traces(one)) == ["vlm-flagship"]
    assert "takes no images" in _page(client, world.operator, tier="text")


def test_the_totals_table_has_a_line_per_tenant_and_tier_and_their_sum(client, world):
    _daily(world.alice, world.vision, images=2, image_tokens=2448, cached_image_tokens=1224,
           cost=Decimal("2.551"), cache_savings=Decimal("0.184"))
    _daily(world.alice, world.vision, days_ago=4, images=1, image_tokens=1224, cost=Decimal("1.367"))
    _daily(world.bob, world.text, text_tokens=500, output_tokens=50, cost=Decimal("0.13"))
    _daily(world.bob, world.text, days_ago=2, requests=2, unbilled_requests=2)  # not billed: counted, nothing more
    _daily(world.bob, world.text, days_ago=40, text_tokens=99_999, cost=Decimal("5"))  # before the period

    page = _page(client, world.operator)

    def cells(html):
        return re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", html)

    alice = page.split('data-tenant="alice" data-tier="vlm-lite">')[1].split("</tr>")[0]
    assert cells(alice) == ["alice", "vlm-lite", "2", "0", "3", "3672", "1224", "0", "0", "3.92 USD", "0.18 USD"]
    bob = page.split('data-tenant="bob" data-tier="text">')[1].split("</tr>")[0]
    assert cells(bob) == ["bob", "text", "3", "2", "0", "0", "0", "500", "50", "0.13 USD", "0.00 USD"]
    total = page.split('id="usage-table-total">')[1].split("</tr>")[0]
    assert cells(total) == ["Total", "5", "2", "3", "3672", "1224", "500", "50", "4.05 USD", "0.18 USD"]


def test_an_empty_period_says_so(client, world):
    page = _page(client, world.operator)
    assert 'id="no-usage"' in page and 'id="no-image-costs"' in page
    assert "No usage in this period." in page


def _bulk_usage(tenants, tiers, *, days: int, per_day: int, start: int = 0):
    """Events with two images each, spread over `days` days, tenants and tiers."""
    now = timezone.now()
    events = [
        UsageEvent(request_id=f"bulk-{start + n}", created_at=now - dt.timedelta(days=n % days, minutes=n % 50),
                   tenant=tenants[n % len(tenants)], tier=tiers[n % len(tiers)], status="ok", image_count=2,
                   image_tokens=1224 + n % 7, cached_image_tokens=0, cost=Decimal("0.002"))
        for n in range(days * per_day)
    ]
    UsageEvent.objects.bulk_create(events)
    UsageImage.objects.bulk_create(
        UsageImage(event=event, created_at=event.created_at, position=p, source_format="JPEG", source_width=64, source_height=64, width=64,
                   height=64, tokens=(event.image_tokens if p == 0 else 0), fingerprint=f"{event.pk}-{p}",
                   cached=p == 1)
        for event in events for p in (0, 1))
    _roll_up()


@pytest.mark.parametrize("period", ["24h", "30d", "90d"])
def test_the_page_makes_the_same_few_queries_however_many_events_lie_behind_it(
        client, world, period, django_assert_max_num_queries):
    flagship = VisionTierFactory(name="vlm-flagship")
    _bulk_usage([world.alice, world.bob], [world.vision], days=1, per_day=2)
    client.force_login(world.operator)
    with CaptureQueriesContext(connection) as few:
        assert client.get("/usage/", {"period": period}).status_code == 200
    assert len(few) <= 14  # two of them: the service's own traffic, shown apart, and the keys to filter by

    tenants = [world.alice, world.bob, world.charlie, *(TenantFactory() for _ in range(5))]
    _bulk_usage(tenants, [world.vision, flagship, world.text], days=60, per_day=20, start=10)
    assert UsageEvent.objects.count() > 1000
    with django_assert_max_num_queries(len(few)):
        page = client.get("/usage/", {"period": period}).content.decode()
    assert "cost-per-image-chart" in page


def test_images_without_a_price_are_left_out_of_the_average_not_counted_free(client, world):
    from controlplane.catalog.models import PricePlan

    unpriced = VisionTierFactory(name="vlm-unpriced", price_plan=PricePlan.objects.create(name="no-rate-yet"))
    now = timezone.now()
    _request("priced", world.alice, world.vision, now, [(1224, False)])  # 0.001367
    _request("unpriced", world.alice, unpriced, now, [(1224, False)] * 3)
    _roll_up()
    title = _title(_figures(_page(client, world.operator))["cost-per-image-chart"])
    assert title.endswith(": 4 images, 0.001367 USD each on average")


def test_a_page_of_tiers_in_two_currencies_never_adds_them(client, world):
    from controlplane.catalog.models import PricePlan, PriceRate

    euros = PricePlan.objects.create(name="euros", currency="EUR")
    PriceRate.objects.create(plan=euros, effective_from=timezone.now() - dt.timedelta(days=90),
                             image_per_mtok=Decimal("1"))
    euro_tier = VisionTierFactory(name="vlm-euro", price_plan=euros)
    _daily(world.alice, world.vision, images=1, image_tokens=1224, cost=Decimal("1.37"))
    _daily(world.alice, euro_tier, images=1, image_tokens=1000, cost=Decimal("1.00"))
    page = _page(client, world.operator)
    cards = page.split('id="usage-totals"')[1].split("</section>")[0]
    assert "<span>1.37 USD</span>cost" in cards and "<span>1.00 EUR</span>cost" in cards
    assert "2.37" not in page  # dollars and euros are never summed
    assert 'data-currency="EUR"' in page.split('id="usage-table"')[1]
    figures = _figures(page)
    assert "each tier's currency" in _title(figures["cost-chart"])
    assert "cost-by-tenant-chart" not in figures  # a tenant's cost over tiers in two currencies


def test_a_filter_naming_nothing_is_refused_with_a_message_not_ignored(client, world):
    DailyUsage.objects.create(day=timezone.now().date(), tenant=world.alice, tier=world.vision, requests=3,
                              images=3, image_tokens=777_001, cost="1.5")
    client.force_login(world.operator)
    response = client.get("/usage/", {"period": "7y", "tenant": "nobody", "colour": "red"})
    page = response.content.decode()
    assert response.status_code == 400
    refused = page.split('id="filter-refused"')[1].split("</p>")[0]
    assert "no period &#x27;7y&#x27;" in refused and "no tenant &#x27;nobody&#x27;" in refused
    assert "unknown filter &#x27;colour&#x27;" in refused
    assert "777001" not in page and "777,001" not in page  # no figures for a filter it did not understand
    client.force_login(world.alice_admin)
    assert client.get("/usage/", {"tenant": "bob"}).status_code == 400  # not a tenant an admin of alice sees


def _keyed_request(request_id, key, tier, when):
    picture = normalise(image_bytes(64, 64), Policy())
    return usage_record(record=UsageRecord(
        request_id=request_id, tenant_id=key.tenant_id, api_key_id=key.pk, tier_id=tier.pk, status="ok",
        images=[(picture, 1224, False)], image_tokens=1224, text_tokens=20, output_tokens=5, created_at=when))


def _exported_request_ids(client, page: str) -> list[str]:
    link = html.unescape(page.split('id="export-images"')[0].rsplit('href="', 1)[1].split('"')[0])
    response = client.get(link)
    assert response.status_code == 200, response.content
    rows = csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode()))
    return sorted(row["request_id"] for row in rows)


def test_the_per_image_report_link_downloads_the_pages_tenant_tier_key_and_period(client, world):
    flagship = VisionTierFactory(name="vlm-flagship")
    main = ApiKey.objects.get(tenant=world.alice)
    other = api_key_create(tenant=world.alice, name="other").api_key
    bobs = ApiKey.objects.get(tenant=world.bob)
    now = timezone.now()
    _keyed_request("wanted", main, world.vision, now)
    _keyed_request("wanted-yesterday", main, world.vision, now - dt.timedelta(days=1))
    _keyed_request("other-tier", main, flagship, now)
    _keyed_request("other-key", other, world.vision, now)
    _keyed_request("other-tenant", bobs, world.vision, now)
    _keyed_request("before-the-period", main, world.vision, now - dt.timedelta(days=45))
    _roll_up()

    client.force_login(world.finance)
    page = client.get("/usage/", {"tenant": "alice", "tier": "vlm-lite", "key": main.prefix}).content.decode()
    assert _exported_request_ids(client, page) == ["wanted", "wanted-yesterday"]
    label = page.split('id="export-images">')[1].split("</a>")[0]
    assert "alice" in label and "vlm-lite" in label and main.prefix in label and "every tier" not in label

    page = client.get("/usage/", {"tenant": "alice", "period": "90d"}).content.decode()
    assert _exported_request_ids(client, page) == ["before-the-period", "other-key", "other-tier", "wanted",
                                                   "wanted-yesterday"]
    page = client.get("/usage/", {"key": other.prefix}).content.decode()  # a key names its tenant
    assert _exported_request_ids(client, page) == ["other-key"]


def _number(page: str, element_id: str) -> int:
    return int(page.split(f'id="{element_id}">')[1].split("<")[0].replace(",", ""))


def test_the_usage_pages_requests_are_the_statements_billed_ones_and_those_not_billed(client, world):
    now = timezone.now()
    for n in range(3):
        _request(f"ok-{n}", world.alice, world.vision, now, [(1224, False)])
    _request("aborted", world.alice, world.vision, now, [(1224, False)], status="aborted")  # before any engine
    for n in range(2):
        _request(f"failed-{n}", world.alice, world.vision, now, [(1224, False)], status="error")
    _roll_up()

    usage = _page(client, world.finance, tenant="alice")
    shown = _number(usage, "total-requests")
    meaning = usage.split('id="requests-meaning"')[1].split("</p>")[0]
    billed, unbilled = _number(meaning, "billed-requests"), _number(meaning, "unbilled-requests")
    assert "Requests are billed requests" not in meaning

    statement = client.get("/statements/", {"tenant": "alice", "month": f"{now:%Y-%m}"}).content.decode()
    lines = statement.split('id="statement"')[1].split("</tbody>")[0].split("<tr data-tier=")[1:]
    on_statement = sum(int(re.findall(r"<td[^>]*>([^<]*)</td>", line)[1].replace(",", "")) for line in lines)
    not_billed = _number(statement, "statement-unbilled")
    assert (shown, billed, unbilled) == (6, 3, 3)
    assert on_statement == billed and not_billed == unbilled and shown == on_statement + not_billed


def test_nothing_spent_reads_as_zero_in_the_currency_its_tiers_bill_in(client, world):
    cards = _page(client, world.finance).split('id="usage-totals"')[1].split("</div>\n</div>")[0]
    assert "<span>0.00 USD</span>cost" in cards and "<span>0.00 USD</span>saved by cached images" in cards
