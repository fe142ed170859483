"""Error pages are product pages, with DEBUG off as `make run` serves: inside the layout,
saying why, with a way out."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.test import AsyncClient, Client
from django.urls import include, path

pytestmark = pytest.mark.django_db


@pytest.fixture
def as_make_run(settings):
    """DEBUG off, as `make run` serves: Django's own error pages are never shown."""
    settings.DEBUG = False


def _in_the_layout_with_a_way_out(page: str) -> bool:
    return '<header class="top">' in page and "<main>" in page and 'href="/"' in page


def test_a_user_with_no_role_is_told_why_and_can_log_out(client, world, as_make_run):
    nobody = get_user_model().objects.create_user("nobody", password="x")
    client.force_login(nobody)
    response = client.get("/")
    page = response.content.decode()
    assert response.status_code == 403 and 'id="forbidden"' in page
    assert "has no role yet" in page and 'action="/logout/"' in page and "<nav>" in page


def test_a_finance_user_on_an_operator_page_is_told_so_and_sent_back(client, world, as_make_run):
    client.force_login(world.finance)
    response = client.get("/fleet/")
    page = response.content.decode()
    assert response.status_code == 403 and "not open to your role (finance)" in page
    assert _in_the_layout_with_a_way_out(page) and "<nav>" in page  # the reader's own menus, to go elsewhere


def test_an_unknown_page_is_a_404_inside_the_layout(client, world, as_make_run):
    client.force_login(world.operator)
    response = client.get("/tiers/no-such-tier/")
    page = response.content.decode()
    assert response.status_code == 404 and 'id="not-found"' in page and _in_the_layout_with_a_way_out(page)


def _fails(request):
    raise RuntimeError("a bug")


urlpatterns = [path("fails/", _fails), path("", include("controlplane.urls"))]


def test_a_form_sent_with_a_stale_token_is_refused_on_the_products_page_with_a_way_out(world, as_make_run):
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(world.operator)
    response = strict.post("/keys/", {"tenant": world.alice.pk, "name": "stale"})
    page = response.content.decode()
    assert response.status_code == 403 and 'id="csrf-failed"' in page and _in_the_layout_with_a_way_out(page)
    assert "CSRF verification failed" not in page and "Reload the page" in page


@pytest.mark.urls(__name__)
def test_a_server_error_is_the_products_500_inside_the_layout_under_wsgi_and_asgi(client, world, as_make_run):
    client.raise_request_exception = False
    client.force_login(world.operator)
    served = AsyncClient(raise_request_exception=False)
    served.force_login(world.operator)
    for response in (client.get("/fails/"), async_to_sync(served.get)("/fails/")):
        page = response.content.decode()
        assert response.status_code == 500 and 'id="server-error"' in page and _in_the_layout_with_a_way_out(page)
        assert "a bug" not in page and "Traceback" not in page


def test_a_request_django_refuses_itself_is_the_products_400(client, world, as_make_run):
    response = client.get("/", HTTP_HOST="elsewhere.example")  # a host the service does not answer for
    page = response.content.decode()
    assert response.status_code == 400 and 'id="bad-request"' in page and _in_the_layout_with_a_way_out(page)
