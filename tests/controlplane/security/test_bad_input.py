"""Bad input where a user can send it (export links, statement periods, estimates, OpenAI
parameters, message counts) is a clear 400, never reflected; the embedded database and key
are their owner's alone; logins are throttled."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

SCRIPT = "<img src=x onerror=alert(document.domain)>"


def test_an_unknown_tenant_in_an_export_link_is_not_reflected_as_html(client, world):
    client.force_login(world.finance)
    response = client.get("/exports/images.csv", {"tenant": SCRIPT})
    assert response.status_code == 400
    assert response["Content-Type"].startswith("text/plain")
    assert response["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("period", ["0000-01", "10000-01", "9999-12", "2026-13", "2026-1x", "-1-01", "٢٠٢٦-٠١"])
def test_a_statement_for_a_month_that_cannot_exist_is_a_400(client, world, period):
    response = client.get(f"/api/v1/statements/{period}/", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert response.status_code == 400, response.content
    assert "period" in response.json()


@pytest.mark.parametrize("fields", [
    {"width": 100000, "height": 1}, {"width": 100000, "height": 100000}, {"width": 1, "height": 100000},
    {"width": 640, "height": 480, "text_tokens": "9" * 31}, {"width": 640, "height": 480, "output_tokens": 10**20},
])
def test_an_estimate_out_of_any_range_is_a_400(client, world, fields):
    response = client.post("/api/v1/estimate/", {"tier": "vlm-lite", **fields},
                           HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert response.status_code == 400, response.content


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot"), ("temperature", 9), ("top_p", -1), ("seed", "x"), ("stop", [1, 2]),
    ("stop", ["a"] * 17), ("logprobs", "yes"), ("top_logprobs", 99), ("logit_bias", {"1": "x"}),
    ("user", {"id": 1}), ("tools", "all"), ("presence_penalty", True), ("metadata", [1]),
    ("metadata", {"task": [[["deep"]]]}), ("metadata", {"task": "x" * 513}), ("metadata", {"k" * 65: "v"}),
])
def test_an_openai_parameter_of_the_wrong_type_is_a_400_naming_it(client, world, field, value):
    from tests.controlplane.gateway.calls import post

    response = post(client, world.alice_key, {"model": "text", "messages": [{"role": "user", "content": "hi"}],
                                              field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "invalid_type")


def test_a_request_with_too_many_messages_or_parts_is_a_400(client, world):
    from tests.controlplane.gateway.calls import post

    many = [{"role": "user", "content": "hi"}] * 2049
    assert post(client, world.alice_key, {"model": "text", "messages": many}).status_code == 400
    parts = [{"type": "text", "text": "x"}] * 4097
    response = post(client, world.alice_key, {"model": "text", "messages": [{"role": "user", "content": parts}]})
    assert response.status_code == 400 and "at most 4096" in response.json()["error"]["message"]


def test_the_embedded_database_and_secret_key_are_readable_by_their_owner_alone(tmp_path):
    import os
    import subprocess
    import sys

    from django.conf import settings

    env = {"PATH": os.environ["PATH"], "DEBUG": "true", "VAR_DIR": str(tmp_path / "var"),
           "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], env=env, cwd=settings.BASE_DIR,
                   check=True, capture_output=True)
    var = tmp_path / "var"
    for path in (var, var / "controlplane.sqlite3", var / "secret_key"):
        assert path.stat().st_mode & 0o077 == 0, f"{path} is open to others: {oct(path.stat().st_mode)}"


def test_logins_are_throttled_after_repeated_failures(client, world, settings):
    for _attempt in range(settings.AXES_FAILURE_LIMIT - 1):
        failed = client.post("/login/", {"username": world.operator.username, "password": "guess"})
        assert failed.status_code == 200  # the form again, with its error
    last = client.post("/login/", {"username": world.operator.username, "password": "guess"})
    assert last.status_code == 429  # the limit reached: locked out, told so in a page with a way back
    assert "Too many failed logins" in last.content.decode() and 'href="/login/"' in last.content.decode()
    world.operator.set_password("right")
    world.operator.save()
    locked = client.post("/login/", {"username": world.operator.username, "password": "right"})
    assert locked.status_code == 429  # even the right password, until the lockout ends
    spoofed = client.post("/login/", {"username": world.operator.username, "password": "right"},
                          HTTP_X_FORWARDED_FOR="203.0.113.9")
    assert spoofed.status_code == 429  # a forged address is no way around it
    other = client.post("/login/", {"username": world.finance.username, "password": "guess"})
    assert other.status_code == 200  # other users are not locked out
