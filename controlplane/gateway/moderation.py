"""Moderation for tiers that require it, through an endpoint that speaks OpenAI's
/v1/moderations format (OpenAI itself, or a self-hosted classifier behind the same API).

The whole prompt is checked: the text of every message, and each image as the engine would
receive it (after the resolution policy). OpenAI's omni-moderation takes one image a call and
gives one verdict for a call's whole input, so the text goes with the first image and every
other image in a call of its own, all at once. A tier that requires moderation fails closed:
if the endpoint cannot answer, the request is refused. MODERATION_URL is an operator-set URL,
vetted at each call (upstream.Connections.client).
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from django.conf import settings

from controlplane.gateway.apps import current_process

log = logging.getLogger(__name__)
TEXT = "the prompt's text"
IMAGES_PER_CALL = 1  # OpenAI refuses more with 400 too_many_images


class Flagged(Exception):
    def __init__(self, subject: str, categories: list[str]):
        self.subject, self.categories = subject, categories
        super().__init__(f"{subject} was flagged by moderation: {', '.join(categories) or 'unspecified'}")


class Unavailable(Exception):
    pass


def prompt_text(messages: list) -> str:
    """The text of every message, in order: string contents and text parts."""
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content
                         if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))
    return "\n\n".join(text for text in texts if text.strip())


def _calls(text: str, data_urls: list[str]) -> list[tuple[list[dict], dict[str, str]]]:
    """Each call's input, and what each input type in it is, to name what was flagged."""
    calls = []
    for first in range(0, max(len(data_urls), 1), IMAGES_PER_CALL):
        parts, subjects = [], {}
        if first == 0 and text:
            parts.append({"type": "text", "text": text})
            subjects["text"] = TEXT
        batch = data_urls[first:first + IMAGES_PER_CALL]
        parts.extend({"type": "image_url", "image_url": {"url": url}} for url in batch)
        if batch:
            subjects["image"] = " and ".join(f"image {n}" for n in range(first + 1, first + 1 + len(batch)))
        if parts:
            calls.append((parts, subjects))
    return calls


def _flagged_subject(result: dict, categories: list[str], subjects: dict[str, str]) -> str:
    # A verdict covers the call's whole input; the input types each flagged category applies
    # to say which part it can have come from (harassment is read in text only, say).
    applied = result.get("category_applied_input_types") or {}
    kinds = {kind for category in categories for kind in (applied.get(category) or subjects.keys())}
    named = [subject for kind, subject in subjects.items() if kind in kinds] or list(subjects.values())
    return " or ".join(named)


async def _check(parts: list[dict], subjects: dict[str, str]) -> None:
    headers = {"Authorization": f"Bearer {settings.MODERATION_API_KEY}"} if settings.MODERATION_API_KEY else {}
    body = {"model": settings.MODERATION_MODEL, "input": parts}
    try:
        response = await current_process().connections.client().post(settings.MODERATION_URL, json=body, headers=headers,
                                                timeout=settings.MODERATION_TIMEOUT_S)
        response.raise_for_status()
        results = response.json()["results"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        # Where the endpoint is and why it failed are the operator's to read, not the tenant's.
        log.warning("the moderation endpoint did not answer: %s", exc)
        raise Unavailable("the moderation service did not answer") from None
    for result in results:
        if result.get("flagged"):
            categories = sorted(name for name, hit in (result.get("categories") or {}).items() if hit)
            raise Flagged(_flagged_subject(result, categories, subjects), categories)


async def moderate(messages: list, data_urls: list[str]) -> None:
    """Raise Flagged for the first flagged part of the prompt (its text, then its images), or
    Unavailable; return when all are clean."""
    if not settings.MODERATION_URL:
        raise Unavailable("this model requires moderation, but no moderation service is configured")
    calls = _calls(prompt_text(messages), data_urls)
    outcomes = await asyncio.gather(*(_check(parts, subjects) for parts, subjects in calls), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
