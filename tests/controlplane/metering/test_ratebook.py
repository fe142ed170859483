"""The rate book answers which rate is in effect, for every reader, with one query per batch
of plans, and a price change mid-period splits what each side of it costs."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.catalog.models import PricePlan, PriceRate, priced_plans
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.metering.rating import Rates, price_parts

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]
MARCH = dt.datetime(2025, 3, 1, tzinfo=dt.UTC)


def _plan(name, *starts_and_prices):
    plan = PricePlan.objects.create(name=name)
    for start, image_per_mtok in starts_and_prices:
        PriceRate.objects.create(plan=plan, effective_from=start, image_per_mtok=Decimal(image_per_mtok))
    return plan


def test_the_rate_in_effect_is_the_latest_started_and_none_before_the_first():
    mid = MARCH + dt.timedelta(days=15)
    plan = _plan("vision", (MARCH, "1"), (mid, "2"))
    book = RateBook()
    with pytest.raises(NoRate):
        book.rate_at(plan.pk, MARCH - dt.timedelta(seconds=1))
    assert book.rates_at(plan.pk, MARCH).image_per_mtok == Decimal("1")
    assert book.rates_at(plan.pk, mid - dt.timedelta(microseconds=1)).image_per_mtok == Decimal("1")
    assert book.rates_at(plan.pk, mid).image_per_mtok == Decimal("2")
    # An image is priced by the rate its request names; one no rate priced has no price.
    assert book.image_price(None, 1000, 0) is None
    assert book.image_price(book.rate_at(plan.pk, mid).pk, 1_000_000, 0) == Decimal("2")


def test_a_book_reads_its_plans_once_however_many_prices_it_answers():
    plans = [_plan(f"plan-{n}", (MARCH, str(n + 1))) for n in range(3)]
    book = RateBook()
    with CaptureQueriesContext(connection) as queries:
        book.load(p.pk for p in plans)
        for day in range(28):
            for plan in plans:
                book.image_price(book.rate_at(plan.pk, MARCH + dt.timedelta(days=day)).pk, 1200 + day, day)
    assert len(queries) == 1


def test_only_plans_with_a_rate_in_effect_are_priced():
    live, future, empty = _plan("live", (MARCH, "1")), _plan("future", (MARCH + dt.timedelta(days=9), "1")), \
        _plan("empty")
    assert priced_plans([live.pk, future.pk, empty.pk], MARCH + dt.timedelta(days=1)) == {live.pk}


@settings(max_examples=300, deadline=None)
@given(images=st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 20_000)), max_size=5),
       text=st.integers(0, 200_000), output=st.integers(0, 50_000), unlined=st.integers(0, 5_000),
       image_rate=st.decimals("0", "50", places=4), fee=st.decimals("0", "0.01", places=6),
       discount=st.decimals("0", "1", places=2))
def test_a_request_priced_by_the_book_costs_what_price_parts_says(images, text, output, unlined, image_rate, fee,
                                                                  discount):
    """The ingest prices requests through the book's remembered parts: to the micro-unit what
    price_parts gives, whatever the rate, the images, their cached shares and the fee."""
    images = [(tokens, min(cached, tokens)) for tokens, cached in images]
    rate = PriceRate(pk=1, text_input_per_mtok=Decimal("0.15"), image_per_mtok=image_rate,
                     output_per_mtok=Decimal("0.6"), per_image_fee=fee, cached_image_discount=discount)
    book = RateBook()
    book._by_id[1] = rate  # a rate read already, as load leaves it
    for _twice in range(2):  # the second time from what the book remembers
        assert book.request_price(1, images, text_tokens=text, output_tokens=output,
                                  unlined=(unlined, unlined // 2)) == price_parts(
            images=images, text_tokens=text, output_tokens=output, rates=Rates.of(rate),
            unlined=(unlined, unlined // 2)).total
