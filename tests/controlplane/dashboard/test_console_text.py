"""Text on the product pages is text: names quoted in help and labels show as code, never as
the backticks they are written with."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.template import Context, Template

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
