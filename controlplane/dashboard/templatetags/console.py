"""Filters of the product pages."""

import re

from django import template
from django.contrib.humanize.templatetags.humanize import naturaltime
from django.template.defaultfilters import date
from django.utils.html import conditional_escape
from django.utils.safestring import mark_safe

from controlplane.web.money import format_money

register = template.Library()

_CODE = re.compile(r"`([^`<>]+)`")


@register.filter
def code_spans(text) -> str:
    """Text whose `quoted` names (a setting, a model name) are shown as code, not as backticks."""
    return mark_safe(_CODE.sub(r"<code>\1</code>", str(conditional_escape(text))))


@register.filter
def money(amount, currency) -> str:
    """An amount of money as every page writes it: thousands apart, always followed by its
    currency, and to fixed places by what it is, so the same kind of figure reads alike on
    every page:

    - totals and bills (statements, the usage page's totals, what a tier billed, spend and
      budgets): to the cent, "1,234.50 USD";
    - one request's or one image's amount, and prices per unit (`money_each`): to the
      micro-unit, "0.001367 USD", the precision a request's cost is recorded at; to the cent,
      most of them would read 0.00.

    Exports, the API and the PDF invoice keep every amount to the micro-unit, so a total here
    is their exact figure rounded to the cent. "—" for no amount (None)."""
    return format_money(amount, currency)


@register.filter
def money_each(amount, currency) -> str:
    """`money` for one request's or image's amount, or a price per unit: to the micro-unit."""
    return format_money(amount, currency, each=True)


# A moment to the second, as the pages write it where seconds matter (ISO, with its zone).
MOMENT_TO_THE_SECOND = "Y-m-d H:i:s T"


@register.filter
def with_age(moment) -> str:
    """A moment as every page writes one, ISO with its zone, followed by how long ago it was:
    "2026-12-06 10:11:05 UTC (3 minutes ago)". An age alone changes meaning while the page is
    left open, and cannot be matched with a log line or another page; "never" for no moment."""
    if moment is None:
        return "never"
    return f"{date(moment, MOMENT_TO_THE_SECOND)} ({naturaltime(moment)})"
