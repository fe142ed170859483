"""A real browser (Debian's chromium, driven by Playwright) logs in and sees the chart."""

from __future__ import annotations

import shutil

import openai
import pytest
from playwright.sync_api import expect, sync_playwright

from tests.images import data_url, image_bytes

# One started system serves every test of the group, on one xdist worker.
pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    yield page
    context.close()


def _login(page, base_url, username, password):
    page.goto(f"{base_url}/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()


def test_an_operator_logs_in_and_sees_image_tokens_per_day(system, page):
    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=system.api_key, max_retries=0)
    client.chat.completions.create(
        model="vlm-lite", max_tokens=4,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(1024, 768))}}]}])
    scripts_from_elsewhere = []
    page.on("request", lambda r: r.url.startswith(system.base_url) or scripts_from_elsewhere.append(r.url))

    _login(page, system.base_url, "operator", "operator")
    expect(page.get_by_role("heading", name="Usage, last 30 days")).to_be_visible()

    # The beat rollup runs every 2 s here: reload until today's bar is drawn.
    bars = page.locator("#image-tokens-chart g.trace.bars path")
    for _ in range(30):
        if bars.count():
            break
        page.wait_for_timeout(1000)
        page.reload()
    expect(bars.first).to_be_visible()
    expect(page.locator("#image-tokens-chart .gtitle")).to_have_text("Image tokens per day")
    assert scripts_from_elsewhere == []  # plotly.js is served locally, no CDN

    page.get_by_role("button", name="Log out").click()
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()
    page.goto(f"{system.base_url}/")
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()


def test_a_wrong_password_is_refused(system, page):
    _login(page, system.base_url, "operator", "not-the-password")
    expect(page.get_by_text("didn't match")).to_be_visible()


def test_an_operator_creates_a_key_that_is_shown_once_and_works(system, page):
    _login(page, system.base_url, "operator", "operator")
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Tenant").select_option(label="demo")
    page.get_by_label("Name").fill("from-the-browser")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#issued-key").inner_text().strip()
    assert secret.startswith("vlm-")
    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=secret, max_retries=0)
    assert "auto" in [m.id for m in client.models.list().data]

    page.reload()
    expect(page.locator("#issued-key")).to_have_count(0)  # never shown again


def test_a_finance_user_sees_usage_but_not_fleet_or_keys(system, page):
    _login(page, system.base_url, "finance", "finance")
    expect(page.get_by_role("heading", name="Usage, last 30 days")).to_be_visible()
    expect(page.get_by_role("link", name="API keys")).to_have_count(0)
    response = page.goto(f"{system.base_url}/keys/")
    assert response.status == 403
