"""Image moderation for tiers that require it, through an endpoint that speaks OpenAI's
/v1/moderations format (OpenAI itself, or a self-hosted classifier behind the same API).

Each image is checked as the engine would receive it (after the resolution policy). A tier
that requires moderation fails closed: if the endpoint cannot answer, the request is refused.
"""

from __future__ import annotations

import asyncio

import httpx
from django.conf import settings

from controlplane.gateway import upstream


class Flagged(Exception):
    def __init__(self, index: int, categories: list[str]):
        self.index, self.categories = index, categories
        super().__init__(f"image {index + 1} was flagged by moderation: {', '.join(categories) or 'unspecified'}")


class Unavailable(Exception):
    pass


async def _check(index: int, data_url: str) -> None:
    headers = {"Authorization": f"Bearer {settings.MODERATION_API_KEY}"} if settings.MODERATION_API_KEY else {}
    body = {"model": settings.MODERATION_MODEL, "input": [{"type": "image_url", "image_url": {"url": data_url}}]}
    try:
        response = await upstream.client().post(settings.MODERATION_URL, json=body, headers=headers,
                                                timeout=settings.MODERATION_TIMEOUT_S)
        response.raise_for_status()
        results = response.json()["results"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise Unavailable(f"the moderation service did not answer: {exc}") from None
    for result in results:
        if result.get("flagged"):
            categories = sorted(name for name, hit in (result.get("categories") or {}).items() if hit)
            raise Flagged(index, categories)


async def moderate(data_urls: list[str]) -> None:
    """Raise Flagged for the first flagged image, or Unavailable; return when all are clean."""
    if not settings.MODERATION_URL:
        raise Unavailable("this model requires moderation, but no moderation service is configured")
    outcomes = await asyncio.gather(*(_check(i, url) for i, url in enumerate(data_urls)), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, (Flagged, Unavailable)):
            raise outcome
        if isinstance(outcome, BaseException):
            raise outcome
