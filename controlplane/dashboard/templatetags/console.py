"""Filters of the product pages."""

import re

from django import template
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
