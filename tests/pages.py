"""Reading what a product page says back to the user."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from html.parser import HTMLParser


def field_errors(page: str) -> list[str]:
    """The messages shown under the fields of a page's forms."""
    return [html.unescape(part.split("</p>")[0]) for part in page.split('<p class="error">')[1:]]


@dataclass
class Form:
    action: str  # as written: empty for the page itself
    method: str  # get or post
    fields: dict[str, list[str]] = field(default_factory=dict)  # name: what it offers, what it sends first
    files: list[str] = field(default_factory=list)
    typed: dict[str, str] = field(default_factory=dict)  # the fields written in, not chosen: their type

    def as_sent(self) -> dict[str, str]:
        """What submitting it untouched sends (a box or a choice: the first it offers)."""
        return {name: values[0] for name, values in self.fields.items() if values}


def page_forms_and_links(page: str) -> tuple[list[Form], list[str]]:
    """The forms of a page, with their fields, and the addresses its links go to."""
    reader = _Reader()
    reader.feed(page)
    return reader.forms, reader.links


class _Reader(HTMLParser):
    def __init__(self):
        super().__init__()
        self.forms: list[Form] = []
        self.links: list[str] = []
        self._form = self._select = self._textarea = None

    def handle_starttag(self, tag, attrs):
        attrs = {name: value or "" for name, value in attrs}
        name = attrs.get("name")
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        elif tag == "form":
            self._form = Form(attrs.get("action", ""), (attrs.get("method") or "get").lower())
            self.forms.append(self._form)
        elif self._form is None:
            return
        elif tag == "input" and name and name != "csrfmiddlewaretoken":
            kind = attrs.get("type", "text")
            if kind == "file":
                self._form.files.append(name)
            else:
                if kind not in ("checkbox", "radio", "hidden", "submit", "button"):
                    self._form.typed[name] = kind
                offered = self._form.fields.setdefault(name, [])
                value = attrs.get("value", "on" if kind in ("checkbox", "radio") else "")
                offered.insert(0, value) if "checked" in attrs else offered.append(value)
        elif tag == "select" and name:
            self._select = self._form.fields.setdefault(name, [])
        elif tag == "option" and self._select is not None and "value" in attrs:
            self._select.insert(0, attrs["value"]) if "selected" in attrs else self._select.append(attrs["value"])
        elif tag == "textarea" and name:
            self._textarea = name
            self._form.fields[name] = [""]
            self._form.typed[name] = "textarea"

    def handle_data(self, data):
        if self._form is not None and self._textarea:
            self._form.fields[self._textarea][0] += data

    def handle_endtag(self, tag):
        if tag == "form":
            self._form = None
        elif tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None
