"""The message posted for an alert: Slack-compatible JSON (`text`, which every Slack-style
receiver shows, and `blocks` for Slack's richer layout). Pure: no Django."""

from __future__ import annotations

import datetime as dt

FIRED, RESOLVED = "fired", "resolved"


def escape(text: str) -> str:
    """Slack reads <, > and & as markup (links, mentions): names and messages are shown as typed."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _when(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _lasted(start: dt.datetime, end: dt.datetime) -> str:
    seconds = max(0, int((end - start).total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def alert_message(*, event: str, rule: str, subject: str, message: str, fired_at: dt.datetime,
                  resolved_at: dt.datetime | None = None, resolution: str = "") -> dict:
    """The body posted when an alert fires or resolves."""
    if event == FIRED:
        headline = f":rotating_light: *FIRING* {escape(rule)} · {escape(subject)}"
        detail = escape(message)
        context = f"fired {_when(fired_at)}"
    else:
        headline = f":white_check_mark: *RESOLVED* {escape(rule)} · {escape(subject)}"
        detail = escape(resolution or "the condition cleared")
        ended = resolved_at or fired_at
        context = f"fired {_when(fired_at)}, resolved {_when(ended)} after {_lasted(fired_at, ended)}"
    return {
        "text": f"{headline}: {detail}",
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"{headline}\n{detail}"}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": context}]},
        ],
    }


def probe_message(*, webhook: str, at: dt.datetime) -> dict:
    text = f":wave: Test message from the VLM control plane to webhook {escape(webhook)}, sent {_when(at)}"
    return {"text": text, "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}
