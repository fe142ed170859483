"""Every product page, in a real browser at 1280×800 and 1440×900, as each role sees it:
nothing runs off the side of the window, no two items of the header overlap, and each menu of
the header, opened in turn, stays inside the window. Screenshots are kept under
var/screenshots/ for review.

One browser serves the whole test and one page each role, resized between the two windows:
starting a browser or a context costs more than reading a page."""

from __future__ import annotations

import datetime as dt
import re
import shutil
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone
from playwright.sync_api import sync_playwright

from controlplane.alerts.models import AlertRule, Webhook
from controlplane.benchmarks.evalsets import evalset_generate
from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun, EvalSet, QualityGate
from controlplane.fleet.models import EngineInstance, EngineMetricSample, Node
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import ApiKey
from tests.controlplane.benchmarks.runs import finished_run, make_profile, sweep

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
SHOTS = Path(__file__).resolve().parents[3] / "var" / "screenshots"
WINDOWS = ((1280, 800), (1440, 900))

# {names} are filled from the furnished world's rows (see _names).
OPERATOR_PAGES = [
    "/", "/usage/", "/requests/", "/operations/", "/playground/", "/tiers/", "/tiers/new/", "/tiers/vlm-lite/",
    "/policies/", "/policies/new/", "/policies/{policy}/", "/fleet/", "/fleet/{engine}/", "/capacity/",
    "/benchmarks/", "/benchmarks/new/", "/benchmarks/from-traffic/", "/benchmarks/{profile}/",
    "/benchmarks/runs/{load_run}/", "/benchmarks/runs/{sweep_run}/", "/benchmarks/compare/?a={load_run}&b={later_run}",
    "/benchmarks/sets/", "/benchmarks/sets/{eval_set}/", "/benchmarks/gates/",
    "/tenants/", "/tenants/new/", "/tenants/alice/", "/tenants/alice/rules/", "/users/", "/keys/", "/keys/{key}/",
    "/rules/", "/prices/", "/prices/{plan}/", "/statements/", "/exports/", "/alerts/", "/alerts/rules/new/",
    "/alerts/rules/{alert_rule}/", "/alerts/webhooks/new/", "/alerts/webhooks/{webhook}/", "/audit/",
    "/requests/req-wide-1/", "/no-such-page/",
]
FINANCE_PAGES = ["/", "/usage/", "/requests/", "/policies/", "/prices/", "/prices/{plan}/", "/statements/",
                 "/exports/", "/audit/"]
TENANT_ADMIN_PAGES = ["/", "/usage/", "/requests/", "/account/", "/account/keys/{key}/", "/account/rules/",
                      "/account/rules/new/", "/statements/", "/playground/"]

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def furnished(world):
    """Some of everything, so that tables have rows and charts have points."""
    node = Node.objects.create(name="gpu-node-with-a-long-name-01", queue="node.wide", last_seen_at=timezone.now())
    engine = EngineInstance.objects.create(tier=world.vision, node=node, port=8001, actual_state="running",
                                           healthy=True, last_health_at=timezone.now())
    for n in range(3):
        EngineMetricSample.objects.create(instance=engine, at=timezone.now() - dt.timedelta(seconds=5 * n),
                                          running=n, waiting=1, kv_cache_usage=0.2)
    usage_record(record=UsageRecord(request_id="req-wide-1", tenant_id=world.alice.pk, api_key_id=None,
                                    tier_id=world.vision.pk, text_tokens=40, output_tokens=9))
    profile = make_profile(world.vision, name="wide-profile")
    finished_run(profile, "before a change", 900.0)
    finished_run(profile, "after a change", 700.0)
    sweep(make_profile(world.vision, name="wide-sweep", kind="resolution"))
    QualityGate.objects.create(tier=world.vision, eval_set=evalset_generate(name="receipts", task="read", count=3,
                                                                            seed=0))
    AlertRule.objects.create(name="errors on vlm-lite", kind="error_rate", threshold=5, tier=world.vision)
    Webhook.objects.create(name="on-call", url="https://hooks.example.com/on-call")
    return world


def _names(world) -> dict[str, object]:
    """What the pages' paths name: a row of each kind the furnished world has."""
    return {"policy": world.vision.resolution_policy.name, "plan": world.vision.price_plan.name,
            "engine": EngineInstance.objects.get(port=8001).pk,
            "profile": BenchmarkProfile.objects.get(name="wide-profile").pk,
            "load_run": BenchmarkRun.objects.get(label="before a change").pk,
            "later_run": BenchmarkRun.objects.get(label="after a change").pk,
            "sweep_run": BenchmarkRun.objects.get(profile__name="wide-sweep").pk,
            "eval_set": EvalSet.objects.get(name="receipts").pk, "key": ApiKey.objects.get(name="alice-main").pk,
            "alert_rule": AlertRule.objects.get(name="errors on vlm-lite").pk,
            "webhook": Webhook.objects.get(name="on-call").pk}


def _session(live_server, user) -> dict:
    client = Client()
    client.force_login(user)
    return {"name": settings.SESSION_COOKIE_NAME, "value": client.cookies[settings.SESSION_COOKIE_NAME].value,
            "url": live_server.url}


def _overflows(page, within: str = "body") -> list[str]:
    """What sticks out past the window's right edge: the page itself, or any visible element
    of `within`."""
    return page.evaluate("""(within) => {
        const width = window.innerWidth, found = [];
        if (document.documentElement.scrollWidth > width) found.push(`page ${document.documentElement.scrollWidth}px`);
        for (const el of document.querySelectorAll(`${within}, ${within} *`)) {
            const box = el.getBoundingClientRect();
            if (box.width && box.height && box.right > width + 1 && getComputedStyle(el).visibility !== 'hidden')
                found.push(`${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''} to ${Math.round(box.right)}px`);
        }
        return found.slice(0, 5);
    }""", within)


def _header_overlaps(page) -> list[str]:
    """Pairs of the header's items (the name, its links, its menus' buttons) drawn over each
    other: what a narrow window squeezes together first."""
    return page.evaluate("""() => {
        const items = [...document.querySelectorAll(
            'header.top .brand, header.top .top-link, header.top .menu > button')]
            .map(el => [el.textContent.trim().split(/\\s+/).join(' '), el.getBoundingClientRect()])
            .filter(([, box]) => box.width && box.height);
        const found = [];
        items.forEach(([a, one], i) => items.slice(i + 1).forEach(([b, two]) => {
            const across = Math.min(one.right, two.right) - Math.max(one.left, two.left);
            const down = Math.min(one.bottom, two.bottom) - Math.max(one.top, two.top);
            if (across > 1 && down > 1) found.push(`"${a}" and "${b}"`);
        }));
        return found;
    }""")


def _menus_open_inside_the_window(page) -> list[str]:
    """Each menu of the header opened in turn, as the keyboard opens it (focus on its button:
    the rule that opens it on hover too), in one call rather than a hover each: what of its
    panel, or of the page, sticks out past the window's right edge while it is open."""
    return page.evaluate("""() => {
        const width = window.innerWidth, found = [];
        for (const menu of document.querySelectorAll('header.top .menu')) {
            menu.querySelector(':scope > button').focus();
            const name = menu.id || menu.className;
            if (document.documentElement.scrollWidth > width)
                found.push(`${name} open: page ${document.documentElement.scrollWidth}px`);
            for (const el of menu.querySelectorAll(':scope > .panel, :scope > .panel *')) {
                const box = el.getBoundingClientRect();
                if (!box.width || !box.height) continue;
                if (box.right > width + 1)
                    found.push(`${name} open: ${el.tagName.toLowerCase()} to ${Math.round(box.right)}px`);
            }
            if (!menu.querySelector(':scope > .panel').getBoundingClientRect().height)
                found.push(`${name} did not open`);
            document.activeElement.blur();
        }
        return found;
    }""")


def _shot_name(path: str) -> str:
    """A screenshot's name, from the page's path as listed (a row named by its kind, not by a
    primary key that differs from run to run): "/fleet/{engine}/" is "fleet_engine"."""
    return re.sub(r"[{}]", "", path.split("?")[0].strip("/")).replace("/", "_") or "home"


def _check(page, role: str, path: str, window: tuple[int, int]) -> list[str]:
    width, height = window
    name = _shot_name(path)
    page.screenshot(path=SHOTS / str(width) / f"{role}-{name}.png", full_page=True)
    found = _overflows(page) + [f"header: {pair} overlap" for pair in _header_overlaps(page)]
    found += _menus_open_inside_the_window(page)
    return [f"{role} {path} at {width}×{height}: {what}" for what in found]


def test_no_page_runs_off_the_side_or_crowds_its_header_at_1280x800_or_1440x900(live_server, furnished, settings):
    # Plain static names, which the live server finds in the sources (hashed ones exist only
    # once collected, and may be stale).
    settings.STORAGES = {**settings.STORAGES, "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}
    names = _names(furnished)
    # Sessions made before the browser starts: Playwright's loop makes this thread async.
    roles = [(role, _session(live_server, user), paths) for role, user, paths in (
        ("operator", furnished.operator, OPERATOR_PAGES), ("finance", furnished.finance, FINANCE_PAGES),
        ("tenant-admin", furnished.alice_admin, TENANT_ADMIN_PAGES))]
    problems = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        for role, session, paths in roles:
            context = browser.new_context()
            context.add_cookies([session])
            page = context.new_page()
            for width, height in WINDOWS:
                page.set_viewport_size({"width": width, "height": height})
                for path in paths:
                    page.goto(live_server.url + path.format(**names))
                    problems += _check(page, role, path, (width, height))
            context.close()
        browser.close()
    assert problems == [], "\n".join(problems)
