"""A chart as plotly writes it into a page, read back: its traces and its layout."""

from __future__ import annotations

import json
import re


def figure_of(html: str, div_id: str = "") -> tuple[list, dict]:
    """The traces and layout of the figure drawn in `div_id` in `html`, or of its first."""
    decoder = json.JSONDecoder()
    name = re.escape(div_id) if div_id else r"[^\"]+"
    at = re.search(rf"Plotly\.newPlot\(\s*\"{name}\",\s*", html).end()
    data, at = decoder.raw_decode(html, at)
    layout, _ = decoder.raw_decode(html, re.compile(r",\s*").match(html, at).end())
    return data, layout


def colour_of_trace(trace: dict) -> str | None:
    """The colour a trace is drawn in: its line's, else its markers'."""
    return (trace.get("line") or {}).get("color") or (trace.get("marker") or {}).get("color")
