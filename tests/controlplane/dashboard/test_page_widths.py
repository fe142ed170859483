"""Every product page, in a real browser at 1280 and 1440 pixels wide, as each role sees it:
nothing runs off the side of the window, and every menu of the header stays inside it.
Screenshots are kept under var/screenshots/ for review."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone
from playwright.sync_api import sync_playwright

from controlplane.fleet.models import EngineInstance, Node
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
SHOTS = Path(__file__).resolve().parents[3] / "var" / "screenshots"
WIDTHS = (1280, 1440)

OPERATOR_PAGES = [
    "/", "/usage/", "/requests/", "/operations/", "/playground/", "/tiers/", "/tiers/new/", "/tiers/vlm-lite/",
    "/policies/", "/policies/new/", "/fleet/", "/capacity/", "/benchmarks/", "/benchmarks/new/",
    "/benchmarks/from-traffic/", "/tenants/", "/tenants/new/", "/tenants/alice/", "/users/", "/keys/", "/prices/",
    "/statements/", "/exports/", "/alerts/", "/audit/", "/requests/req-wide-1/", "/no-such-page/",
]
FINANCE_PAGES = ["/", "/requests/", "/policies/", "/prices/", "/statements/", "/exports/", "/audit/"]
TENANT_ADMIN_PAGES = ["/", "/requests/", "/account/", "/statements/", "/playground/"]

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def furnished(world):
    """Some of everything, so that tables have rows and charts have points."""
    node = Node.objects.create(name="gpu-node-with-a-long-name-01", queue="node.wide", last_seen_at=timezone.now())
    EngineInstance.objects.create(tier=world.vision, node=node, port=8001, actual_state="running", healthy=True,
                                  last_health_at=timezone.now())
    usage_record(record=UsageRecord(request_id="req-wide-1", tenant_id=world.alice.pk, api_key_id=None,
                                    tier_id=world.vision.pk, text_tokens=40, output_tokens=9))
    return world


def _session(live_server, user) -> dict:
    client = Client()
    client.force_login(user)
    return {"name": settings.SESSION_COOKIE_NAME, "value": client.cookies[settings.SESSION_COOKIE_NAME].value,
            "url": live_server.url}


def _overflows(page) -> list[str]:
    """What sticks out past the window's right edge: the page itself, or any visible element."""
    return page.evaluate("""() => {
        const width = window.innerWidth, found = [];
        if (document.documentElement.scrollWidth > width) found.push(`page ${document.documentElement.scrollWidth}px`);
        for (const el of document.querySelectorAll('body *')) {
            const box = el.getBoundingClientRect();
            if (box.width && box.height && box.right > width + 1 && getComputedStyle(el).visibility !== 'hidden')
                found.push(`${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''} to ${Math.round(box.right)}px`);
        }
        return found.slice(0, 5);
    }""")


def test_no_page_runs_off_the_side_at_1280_or_1440_pixels(live_server, furnished, settings):
    # Plain static names, which the live server finds in the sources (hashed ones exist only
    # once collected, and may be stale).
    settings.STORAGES = {**settings.STORAGES, "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}
    # Sessions made before the browser starts: Playwright's loop makes this thread async.
    roles = [(role, _session(live_server, user), paths) for role, user, paths in (
        ("operator", furnished.operator, OPERATOR_PAGES), ("finance", furnished.finance, FINANCE_PAGES),
        ("tenant-admin", furnished.alice_admin, TENANT_ADMIN_PAGES))]
    problems = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        for role, session, paths in roles:
            for width in WIDTHS:
                context = browser.new_context(viewport={"width": width, "height": 900})
                context.add_cookies([session])
                page = context.new_page()
                for path in paths:
                    page.goto(live_server.url + path)
                    name = path.strip("/").replace("/", "_") or "home"
                    page.screenshot(path=SHOTS / str(width) / f"{role}-{name}.png", full_page=True)
                    problems += [f"{role} {path} at {width}: {what}" for what in _overflows(page)]
                    # the last menu of the header, opened, still inside the window
                    menus = page.locator("header.top .menu")
                    if menus.count():
                        menus.last.hover()
                        problems += [f"{role} {path} at {width}, user menu open: {what}"
                                     for what in _overflows(page)]
                        page.mouse.move(0, 400)
                context.close()
        browser.close()
    assert problems == [], "\n".join(problems)
