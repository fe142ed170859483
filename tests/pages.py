"""Reading what a product page says back to the user."""

from __future__ import annotations

import html


def field_errors(page: str) -> list[str]:
    """The messages shown under the fields of a page's forms."""
    return [html.unescape(part.split("</p>")[0]) for part in page.split('<p class="error">')[1:]]
