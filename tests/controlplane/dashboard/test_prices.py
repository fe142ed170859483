"""Operators keep prices in product pages with the billing rules enforced where a price is
typed: no negative amount, a cached discount within 0-100 %, a currency from the list, never a
back-dated or edited rate; a preview shows what a new rate changes; finance reads them."""

from __future__ import annotations

import datetime as dt
import html
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import PricePlan, PriceRate
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record_many
from tests.pages import field_errors

pytestmark = pytest.mark.django_db


def _rate(**changes):
    data = {"effective_from": (timezone.now() + dt.timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S"),
            "text_input_per_mtok": "0.25", "image_per_mtok": "0.40", "output_per_mtok": "0.80",
            "per_image_fee": "0", "cached_image_discount": "50"}
    data.update(changes)
    return data



@pytest.mark.parametrize(("typed", "message"), [
    ({"image_per_mtok": "-0.15"}, "Ensure this value is greater than or equal to 0."),
    ({"cached_image_discount": "150"}, "Ensure this value is less than or equal to 100."),
    ({"effective_from": "2020-01-01 00:00:00"}, "a new rate starts now or later"),
    ({"output_per_mtok": "abc"}, "Enter a number."),
])
def test_a_price_that_cannot_be_billed_is_refused_where_it_is_typed(client, world, typed, message):
    plan = world.vision.price_plan
    before = plan.rates.count()
    client.force_login(world.operator)
    page = client.post(f"/prices/{plan.name}/", {**_rate(**typed), "save": "1"}).content.decode()
    assert any(message in error for error in field_errors(page))
    assert plan.rates.count() == before


def test_a_new_rate_is_previewed_then_added_and_recorded_with_who(client, world):
    plan = world.vision.price_plan
    client.force_login(world.operator)
    page = client.post(f"/prices/{plan.name}/", {**_rate(), "preview": "1"}).content.decode()
    preview = page.split('id="rate-preview"')[1].split("</table>")[0]
    # 1 M text tokens: 0.20 now (the plan's rate), 0.25 at the new one.
    row = preview.split("1 M text input tokens")[1].split("</tr>")[0]
    assert "0.200000" in row and "0.250000" in row and "0.050000" in row
    assert "vlm-lite: a 4032 × 3024 photo (1,232 tokens)" in html.unescape(preview)
    assert plan.rates.count() == 1  # a preview saves nothing
    client.post(f"/prices/{plan.name}/", {**_rate(), "save": "1"})
    new = plan.rates.order_by("-effective_from").first()
    assert (new.image_per_mtok, new.cached_image_discount, new.created_by) == (
        Decimal("0.40"), Decimal("0.5"), world.operator.username)
    assert AuditEntry.objects.filter(object_type="price rate", object_id=str(new.pk),
                                     actor=world.operator.username).exists()


def test_a_plans_page_shows_what_each_rate_billed_and_the_changes_of_its_rates(client, world):
    plan = world.vision.price_plan
    usage_record_many(records=[UsageRecord(request_id=f"billed-{n}", tenant_id=world.alice.pk, api_key_id=None,
                                           tier_id=world.vision.pk, text_tokens=10) for n in range(3)])
    client.force_login(world.operator)
    client.post(f"/prices/{plan.name}/", {**_rate(), "save": "1"})  # a new rate, from an hour on
    page = client.get(f"/prices/{plan.name}/").content.decode()
    billed = [row.split('<td class="num">')[-1].split("</td>")[0] for row in
              page.split("<tbody>")[1].split("</tbody>")[0].split("</tr>")[:-1]]
    assert billed == ["0", '3 <span class="muted">(fixed)</span>']  # newest rate first
    changes = page.split('id="changes"')[1]
    assert world.operator.username in changes and "created price rate" in changes


def test_a_plan_gets_a_currency_from_the_list_and_keeps_it_once_it_has_rates(client, world):
    client.force_login(world.operator)
    page = client.post("/prices/", {"name": "eu-plan", "currency": "EUROS"}).content.decode()
    assert "Select a valid choice." in page and not PricePlan.objects.filter(name="eu-plan").exists()
    assert client.post("/prices/", {"name": "eu-plan", "currency": "EUR"}).status_code == 302
    row = client.get("/prices/").content.decode().split('data-plan="eu-plan"')[1].split("</tr>")[0]
    assert "EUR" in row and "no rate in effect" in row


def test_finance_reads_prices_but_changes_nothing(client, world):
    client.force_login(world.finance)
    assert world.vision.price_plan.name in client.get("/prices/").content.decode()
    assert "New rate" not in client.get(f"/prices/{world.vision.price_plan.name}/").content.decode()
    assert client.post(f"/prices/{world.vision.price_plan.name}/", {**_rate(), "save": "1"}).status_code == 403
    assert client.post("/prices/", {"name": "x", "currency": "USD"}).status_code == 403
    assert PriceRate.objects.filter(plan=world.vision.price_plan).count() == 1


@pytest.mark.parametrize("moment", ["9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+12:00"])
def test_a_rate_from_a_moment_that_cannot_be_written_in_utc_is_refused_and_the_plan_still_opens(
        client, world, moment):
    plan = world.vision.price_plan
    before = plan.rates.count()
    client.force_login(world.operator)
    page = client.post(f"/prices/{plan.name}/", {**_rate(effective_from=moment), "save": "1"}).content.decode()
    assert any("no moment that far out can be kept" in error for error in field_errors(page))
    assert plan.rates.count() == before
    assert client.get(f"/prices/{plan.name}/").status_code == 200
