"""A real browser (Debian's chromium, driven by Playwright) logs in and sees the chart."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil

import openai
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import expect, sync_playwright

from tests.images import data_url, image_bytes
from tests.system.harness import wait_for

# One started system serves every test of the group, on one xdist worker.
pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# The other xdist worker runs the chaos suite (its own system, under load) on these 2 cores, so a
# page can take longer than Playwright's default 5 s to appear; waiting longer changes no outcome.
expect.set_options(timeout=30_000)

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


def _go(page, menu, link):
    """Open one of the header's menus, as a user does (hovering it), and follow a link in it."""
    page.locator(f"#nav-{menu} > button").hover()
    page.locator(f"#nav-{menu} .panel").get_by_role("link", name=link, exact=True).click()


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
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()  # an operator's home: health
    _go(page, "traffic", "Usage")
    expect(page.get_by_role("heading", name="Usage, last 30 days")).to_be_visible()

    # The beat rollup runs every 2 s here: reload until today's bar is drawn (days without
    # usage are drawn as bars of no height, which are not visible).
    bars = page.locator("#image-tokens-chart g.trace.bars path >> visible=true")
    for _ in range(30):
        if bars.count():
            break
        page.wait_for_timeout(1000)
        page.reload()
    expect(bars.first).to_be_visible()
    expect(page.locator("#image-tokens-chart .gtitle")).to_have_text("Image tokens per day")
    assert scripts_from_elsewhere == []  # plotly.js is served locally, no CDN

    page.locator("#user-menu > button").hover()  # the user menu holds Log out
    page.get_by_role("button", name="Log out").click()
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()
    page.goto(f"{system.base_url}/")
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()


def test_plotly_reaches_the_browser_compressed_under_a_hashed_name_cached_for_good(system, page):
    scripts = {}
    page.on("response", lambda r: "plotly" in r.url and scripts.setdefault(r.url, r))
    _login(page, system.base_url, "operator", "operator")
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()  # an operator's home: health
    _go(page, "traffic", "Usage")
    expect(page.get_by_role("heading", name="Usage, last 30 days")).to_be_visible()
    html = page.content()
    assert html.count("plotly-basic.min.") == 1  # one script tag, however many charts
    ((url, response),) = scripts.items()
    assert re.search(r"/static/vendor/plotly-basic\.min\.[0-9a-f]{12}\.js$", url), url
    headers = response.all_headers()
    assert headers["content-encoding"] == "br"  # chromium accepts brotli
    assert "immutable" in headers["cache-control"] and "max-age=315360000" in headers["cache-control"]
    assert int(headers["content-length"]) < 1_400_000  # of 4.8 MB
    # Another page that charts asks for the same file, which the browser already holds.
    page.goto(f"{system.base_url}/policies/")
    assert url.removeprefix(system.base_url) in page.content()


def test_a_wrong_password_is_refused(system, page):
    _login(page, system.base_url, "operator", "not-the-password")
    expect(page.get_by_text("didn't match")).to_be_visible()


def test_an_operator_creates_a_key_that_is_shown_once_and_works(system, page):
    _login(page, system.base_url, "operator", "operator")
    _go(page, "tenants", "API keys")
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


def test_finance_downloads_the_per_image_report_and_monthly_summary_from_the_exports_page(system, page):
    import io

    import openpyxl

    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=system.api_key, max_retries=0)
    sent = client.chat.completions.with_raw_response.create(
        model="vlm-lite", max_tokens=4,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(1600, 1200))}}]}])
    request_id = sent.headers["x-request-id"]

    _login(page, system.base_url, "finance", "finance")
    _go(page, "billing", "Exports")
    expect(page.get_by_role("heading", name="Exports")).to_be_visible()
    this_month = page.locator("#quick-exports tr", has_text="This month so far")

    # The usage stream is ingested every 2 s: download again until the request is in the report.
    for _ in range(20):
        with page.expect_download() as csv_download:
            this_month.filter(has_text="image").get_by_role("link", name="CSV").click()
        report = open(csv_download.value.path(), encoding="utf-8").read()
        if request_id in report:
            break
        page.wait_for_timeout(1000)
    row = next(line.split(",") for line in report.splitlines() if request_id in line)
    assert row[0] == "demo" and row[4:6] == ["1600", "1200"]  # the size it came in at

    with page.expect_download() as xlsx_download:
        this_month.filter(has_text="summary").get_by_role("link", name="XLSX (Excel)").click()
    assert xlsx_download.value.suggested_filename.endswith(".xlsx")
    book = openpyxl.load_workbook(io.BytesIO(open(xlsx_download.value.path(), "rb").read()), read_only=True)
    cells = [row for sheet in book.worksheets for row in sheet.iter_rows(values_only=True)]
    assert any("demo" in row for row in cells)  # the demo tenant has a line this month


def test_finance_sees_every_tenants_month_and_downloads_a_tenants_invoice(system, page):
    import io

    import pypdf

    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=system.api_key, max_retries=0)
    client.chat.completions.create(model="text", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    _login(page, system.base_url, "finance", "finance")
    _go(page, "billing", "Statements")
    expect(page.get_by_role("heading", name=re.compile("Statements of every tenant"))).to_be_visible()
    demo = page.locator("#every-statement tr[data-tenant='demo']")
    for _ in range(20):  # the usage stream is ingested every 2 s
        if demo.count():
            break
        page.wait_for_timeout(1000)
        page.reload()
    amount = demo.locator("td").nth(8).inner_text().split()[0].replace(",", "")  # "1,234.50 USD"
    demo.get_by_role("link", name="demo").click()
    expect(page.get_by_role("heading", name=re.compile("Statement of demo"))).to_be_visible()
    with page.expect_download() as download:
        page.get_by_role("link", name="Invoice (PDF)").click()
    assert download.value.suggested_filename.startswith("invoice-demo-")
    text = pypdf.PdfReader(io.BytesIO(open(download.value.path(), "rb").read())).pages[0].extract_text()
    assert "Tenant: demo" in text and "Total in" in text
    assert float(amount) <= float(text.split("Total in")[1].splitlines()[0].split()[-2])  # what it showed, or since


def test_a_tenant_admin_gives_a_key_a_budget_edits_it_and_rotates_its_secret(system, page):
    _login(page, system.base_url, "demo-admin", "demo-admin")
    _go(page, "tenants", "Keys and quota")
    page.get_by_label("Name").fill("nightly batch")
    page.get_by_label("Budget").fill("5")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#issued-key").inner_text().strip()
    assert f"Bearer {secret}" in page.locator("#issued-curl").inner_text()  # a snippet ready to paste
    expect(page.get_by_role("button", name="Copy").first).to_be_visible()
    row = page.locator("#keys tr", has_text="nightly batch")
    expect(row).to_contain_text("5.00 USD")

    row.get_by_role("link", name="nightly batch").click()
    page.get_by_label("Name").fill("nightly batch v2")
    page.get_by_label("Requests per minute").fill("30")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#keys tr", has_text="nightly batch v2")).to_contain_text("30")

    page.locator("#keys tr", has_text="nightly batch v2").get_by_role("link", name="nightly batch v2").click()
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Rotate secret").click()
    rotated = page.locator("#issued-key").inner_text().strip()
    assert rotated != secret
    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=rotated, max_retries=0)
    assert client.models.list().data  # the new secret works at once

    def old_refused():
        try:
            openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=secret, max_retries=0).models.list()
        except openai.AuthenticationError:
            return True
        return False

    for _ in range(40):  # within the gateway's key cache (seconds)
        if old_refused():
            break
        page.wait_for_timeout(500)
    assert old_refused()


def test_an_operator_points_a_benchmark_at_the_gateway_runs_it_and_sees_its_latencies(system, page):
    _login(page, system.base_url, "operator", "operator")
    _go(page, "models", "Benchmarks")
    page.get_by_role("link", name="text-baseline").first.click()
    form = page.locator("#profile-form")
    form.get_by_label("Gateway url").fill(system.base_url)
    form.get_by_label("Load levels").fill("[2]")
    form.get_by_label("Seconds per level").fill("2")
    form.get_by_role("button", name="Save").click()
    page.get_by_role("button", name="Run now").click()

    # The run page refreshes itself until the Celery worker has finished the run.
    expect(page.locator("#run-state")).to_have_text("succeeded", timeout=90_000)
    rows = page.locator("#results tr[data-class='text']")
    expect(rows.first).to_be_visible()
    expect(page.locator("#latency-chart .main-svg").first).to_be_visible()  # drawn by Plotly


def test_an_operator_is_asked_before_stopping_an_engine_and_the_fleet_page_updates_in_place(system, page):
    _login(page, system.base_url, "operator", "operator")
    _go(page, "models", "Engines and nodes")
    page.evaluate("window.notReloaded = true")
    row = page.locator("#instances tbody tr", has=page.get_by_role("button", name="Stop")).first
    instance = row.get_attribute("data-instance")
    asked = []
    page.on("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.route("**/fleet/*/stop/", lambda route: route.abort())  # if it were sent unasked, the fleet keeps it
    row.get_by_role("button", name="Stop").click()
    assert asked and asked[0].startswith(f"Stop #{instance} now?")
    expect(page.locator(f'#instances tr[data-instance="{instance}"] td').nth(3)).to_have_text("running")
    # The live part of the page is fetched again and swapped in, with no reload of the page.
    page.evaluate("document.querySelector('[data-live] #events').dataset.seen = 'yes'")
    page.wait_for_function("!document.querySelector('[data-live] #events').dataset.seen", timeout=30_000)
    assert page.evaluate("window.notReloaded") is True


def test_no_engine_is_stopped_unasked_while_the_page_that_asks_is_still_loading(system, page):
    # The script that asks before a destructive form is sent arrives late (a slow link). Until it
    # has run, no Stop button may be pressed; a stop sent unasked is caught here, never reaching
    # the fleet (the system is shared by the other tests).
    _login(page, system.base_url, "operator", "operator")
    held, stops = [], []
    page.route("**/static/js/confirm*.js", lambda route: held.append(route))
    page.route("**/fleet/*/stop/", lambda route: (stops.append(route.request.url), route.abort()))
    page.goto(f"{system.base_url}/fleet/", wait_until="commit")
    try:
        page.locator("#instances button", has_text="Stop").first.click(timeout=3_000)
    except PlaywrightTimeoutError:
        pass  # nothing to press yet: the page is not shown before it can ask
    assert stops == []
    for route in held:
        route.continue_()
    asked = []
    page.on("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.locator("#instances button", has_text="Stop").first.click()
    assert asked and asked[0].startswith("Stop #")
    assert stops == []


def test_a_tenant_admin_makes_a_key_for_one_model_that_the_gateway_holds_to_it(system, page):
    _login(page, system.base_url, "demo-admin", "demo-admin")
    _go(page, "tenants", "Keys and quota")
    page.get_by_label("Name").fill("vision only")
    page.get_by_label("vlm-lite").check()
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#issued-key").inner_text().strip()
    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=secret, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["auto", "vlm-lite"]
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="text", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    expect(page.locator("#keys tr", has_text="vision only")).to_contain_text("vlm-lite")


def test_a_tenant_admin_routes_receipts_to_the_flagship_tries_it_and_the_gateway_follows(system, page):
    _login(page, system.base_url, "demo-admin", "demo-admin")
    _go(page, "tenants", "Routing rules")
    page.locator("#new-rule").click()
    page.get_by_label("Name:", exact=True).fill("receipts")
    page.get_by_label("Tasks").fill("receipt")
    page.get_by_label("Send to").select_option(label="vlm-flagship")
    page.get_by_role("button", name="Create rule").click()
    expect(page.locator("table.rules", has_text="receipts")).to_be_visible()

    page.get_by_label("Request body (JSON)").fill(json.dumps({"model": "auto", "metadata": {"task": "Receipt"},
                                                              "messages": [{"role": "user", "content": "total?"}]}))
    page.get_by_role("button", name="Where would it go?").click()
    expect(page.locator("#dry-run-answer")).to_contain_text("would go to vlm-flagship, by rule 1 (receipts)")

    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=system.api_key, max_retries=0)

    def routed():  # the gateway reads a key's rules again within GATEWAY_KEY_CACHE_SECONDS
        return client.chat.completions.create(model="auto", max_tokens=2, metadata={"task": "receipt"},
                                              messages=[{"role": "user", "content": "total?"}]).model
    try:
        wait_for(lambda: routed() == "vlm-flagship", timeout=15, what="the gateway to follow the rule")
        plain = client.chat.completions.create(model="auto", max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
        assert plain.model != "vlm-flagship"  # no task named: where auto went before
    finally:  # the rule goes, asked first, leaving the demo tenant's routing as it was
        page.locator("table.rules").get_by_role("link", name="receipts").click()
        page.on("dialog", lambda dialog: dialog.accept())
        page.get_by_role("button", name="Delete rule").click()
    expect(page.locator("table.rules", has_text="receipts")).to_have_count(0)


def test_an_operator_chats_with_two_models_over_an_image_metered_to_the_services_own_tenant(system, page,
                                                                                              tmp_path):
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(image_bytes(2000, 1500, color=(20, 120, 200)))
    _login(page, system.base_url, "operator", "operator")
    _go(page, "traffic", "Playground")
    expect(page.get_by_label("Metered to")).to_have_value("internal")  # no key pasted: the session's own
    expect(page.get_by_label("Model", exact=True)).to_be_enabled()
    page.get_by_label("Model", exact=True).select_option("vlm-lite")
    page.get_by_label("Compare with").select_option("text")
    page.locator("#pg-image").set_input_files(str(photo))
    expect(page.locator("#pg-estimate")).to_contain_text("Cannot send photo.jpg to text")
    expect(page.get_by_role("button", name="Send")).to_be_disabled()  # a refused image is never sent

    page.get_by_label("Compare with").select_option("vlm-flagship")
    estimate = page.locator("#pg-estimate-line")
    expect(estimate).to_contain_text("vlm-lite: photo.jpg (2000×1500) → ")
    estimated_tokens = int(estimate.get_attribute("data-image-tokens"))
    sent = estimate.inner_text().split("→ ")[1].split(",")[0]
    assert sent != "2000×1500"  # the policy downscales it before the model sees it
    expect(page.locator("#pg-preview img")).to_have_count(1)
    page.get_by_text("System prompt and sampling").click()
    page.get_by_label("System prompt").fill("Answer in one word.")
    page.get_by_label("Temperature").fill("0")

    page.get_by_role("button", name="Send").click()
    expect(page.locator("#pg-usage-cost")).to_contain_text("Cost recorded", timeout=60_000)
    expect(page.locator("#pg-thread-1 .pg-assistant")).to_have_count(1)  # the other model answered too
    assert f"{estimated_tokens:,} image" in page.locator("#pg-usage-tokens").inner_text()
    first_prompt = int(page.locator("#pg-usage-tokens").inner_text().split(" prompt")[0].split()[-1].replace(",", ""))

    page.get_by_label("Message").fill("And its colour?")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#pg-thread-0 .pg-assistant")).to_have_count(2)
    expect(page.locator("#pg-usage-cost")).to_contain_text("Cost recorded", timeout=60_000)
    second_prompt = int(page.locator("#pg-usage-tokens").inner_text().split(" prompt")[0].split()[-1].replace(",", ""))
    assert second_prompt > first_prompt  # the conversation so far, the first answer included
    assert f"{estimated_tokens:,} image" in page.locator("#pg-usage-tokens").inner_text()  # and its image

    page.get_by_role("button", name="View code").click()
    python = page.locator("#pg-code-python").inner_text()
    assert 'model="vlm-lite"' in python and 'image("photo.jpg")' in python and '"temperature"' not in python
    assert "temperature=0" in python and "Answer in one word." in python and '"role": "assistant"' in python
    assert "$VLM_API_KEY" in page.locator("#pg-code-curl").inner_text()

    page.locator("#pg-usage-cost a").click()  # the request log has it, metered to the internal tenant
    expect(page.locator("tr", has_text="Tenant").first).to_contain_text("internal")
    expect(page.locator("#timings")).to_contain_text("Time to first token")


def _sweep_on_a_gated_tier(django_db_blocker, db: str = "system"):
    """A resolution sweep of a tier of its own (disabled: no engine starts for it), whose policy
    changes are gated: 1,003,520 px scores 88 %, 401,408 px 86 % for less than half the cost.
    Written on a thread of its own: Playwright's event loop runs on this one, where Django
    refuses database calls."""
    with django_db_blocker.unblock(), concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_write_sweep_on_a_gated_tier, db).result()


def _write_sweep_on_a_gated_tier(db: str):
    from django.db import connections

    try:
        return _sweep_rows(db)
    finally:
        connections[db].close()


def _sweep_rows(db: str):
    from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun, EvalSet, QualityGate
    from controlplane.catalog.models import ModelTier, PricePlan, ResolutionPolicy

    policy = ResolutionPolicy.objects.using(db).create(name="advised", max_pixels=1_003_520,
                                                       low_detail_max_pixels=200_704)
    tier = ModelTier.objects.using(db).create(
        name="zz-advised", family="qwen2_5_vl", kind="vision", engine_kind="simulator", model_id="advised",
        enabled=False, replicas=0, resolution_policy=policy, price_plan=PricePlan.objects.using(db).get(name="vlm-lite"))
    eval_set = EvalSet.objects.using(db).create(name="advised-gate", source="imported", file_name="gate.jsonl")
    QualityGate.objects.using(db).create(tier=tier, eval_set=eval_set)
    profile = BenchmarkProfile.objects.using(db).create(name="advised-sweep", kind="resolution", tier=tier)
    caps = [{"cap": cap, "requests": 100, "errors": 0, "mean_image_tokens": cap / 784, "cost_per_image": cost,
             "ttft": {"p50": 40.0, "p99": 60.0}, "e2e": {"p50": 90.0, "p99": 120.0}, "tasks": {},
             "overall": {"accuracy": accuracy, "interval": interval, "items": 100}, "answers": []}
            for cap, accuracy, interval, cost in ((200_704, 0.70, [0.61, 0.78], "0.000039"),
                                                  (401_408, 0.86, [0.78, 0.91], "0.000080"),
                                                  (1_003_520, 0.88, [0.80, 0.93], "0.000192"))]
    return BenchmarkRun.objects.using(db).create(
        profile=profile, state="succeeded", progress=1.0, config={"kind": "resolution", "eval_set": "advised-gate"},
        results={"kind": "resolution", "caps": caps})


def test_an_operator_asks_the_advisor_for_a_target_applies_it_and_sees_it_measured_first(system, django_db_blocker,
                                                                                        page):
    run = _sweep_on_a_gated_tier(django_db_blocker)
    _login(page, system.base_url, "operator", "operator")
    page.goto(f"{system.base_url}/benchmarks/runs/{run.pk}/")
    expect(page.locator("#set-curve-chart .main-svg").first).to_be_visible()
    advisor = page.locator("#advisor")
    advisor.get_by_label("Target").select_option("within")
    advisor.get_by_label("Points").fill("3")
    advisor.get_by_role("button", name="Advise").click()
    expect(page.locator("#advice-summary")).to_contain_text("401,408 px is the smallest cap within 3 points")
    expect(page.locator("#advice")).to_contain_text("within the set's noise")

    page.get_by_role("button", name="Check and apply 401408 px to advised").click()
    expect(page.get_by_role("heading", name=re.compile(r"check #\d+ of policy advised"))).to_be_visible()
    changed = page.locator("#changed")
    expect(changed).to_contain_text("max pixels")
    expect(changed).to_contain_text("401408")
    expect(page.locator("#log")).to_contain_text(f"from the advisor: run {run.pk}")
