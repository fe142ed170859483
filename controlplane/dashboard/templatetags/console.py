"""Filters of the product pages."""

import re

from django import template
from django.utils.html import conditional_escape
from django.utils.safestring import mark_safe

register = template.Library()

_CODE = re.compile(r"`([^`<>]+)`")


@register.filter
def code_spans(text) -> str:
    """Text whose `quoted` names (a setting, a model name) are shown as code, not as backticks."""
    return mark_safe(_CODE.sub(r"<code>\1</code>", str(conditional_escape(text))))
