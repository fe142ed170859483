"""Under load, against the started system: 500 requests at once on one gateway process, with
a quota, each answered 200 or 429 (never a 500), each metered once, and the quota never
overshot."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from controlplane.metering.models import UsageEvent
from tests.system.harness import wait_for

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]
AT_ONCE, LIMIT = 500, 4000  # total tokens a day: room for a third of them or so


def test_500_requests_at_once_on_one_gateway_are_each_a_200_or_a_429_and_metered_once(system, system_db):
    system.manage("shell", "-c", "from controlplane.tenants.models import Tenant, Quota; "
                  "t, _ = Tenant.objects.get_or_create(name='crowd'); "
                  f"Quota.objects.update_or_create(tenant=t, defaults={{'period': 'day', 'total_tokens': {LIMIT}}})")
    secret = system.manage("create_api_key", "--tenant", "crowd").stdout.strip()
    body = {"model": "text", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

    async def crowd():
        limits = httpx.Limits(max_connections=AT_ONCE, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=system.base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=body,
                                                      headers={"Authorization": f"Bearer {secret}"})
                                          for _ in range(AT_ONCE)), return_exceptions=True)

    answers = asyncio.run(crowd())
    statuses = [a.status_code if isinstance(a, httpx.Response) else type(a).__name__ for a in answers]
    assert set(statuses) <= {200, 429}, {s: statuses.count(s) for s in set(statuses)}
    assert statuses.count(200) and statuses.count(429)
    ids = {a.headers["x-request-id"] for a in answers}
    events = wait_for(lambda: (found := list(UsageEvent.objects.using(system_db).filter(request_id__in=ids)))
                      and len(found) == AT_ONCE and found, timeout=60, what="every request metered")
    assert sorted(e.http_status for e in events) == sorted(statuses)
    used = sum(e.image_tokens + e.text_tokens + e.output_tokens for e in events if e.status == "ok")
    assert 0 < used <= LIMIT  # the quota never overshot
