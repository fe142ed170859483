"""403 and 404 pages are product pages: inside the layout, saying why, with a way out."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.urls import include, path

pytestmark = pytest.mark.django_db


def test_a_user_with_no_role_is_told_why_and_can_log_out(client, world):
    nobody = get_user_model().objects.create_user("nobody", password="x")
    client.force_login(nobody)
    response = client.get("/")
    page = response.content.decode()
    assert response.status_code == 403 and 'id="forbidden"' in page
    assert "has no role yet" in page and 'action="/logout/"' in page and "<nav>" in page


def test_a_finance_user_on_an_operator_page_is_told_so_and_sent_back(client, world):
    client.force_login(world.finance)
    page = client.get("/fleet/").content.decode()
    assert "not open to your role (finance)" in page and 'href="/"' in page


def test_an_unknown_page_is_a_404_inside_the_layout(client, world):
    client.force_login(world.operator)
    response = client.get("/tiers/no-such-tier/")
    assert response.status_code == 404 and 'id="not-found"' in response.content.decode()


def _fails(request):
    raise RuntimeError("a bug")


urlpatterns = [path("fails/", _fails), path("", include("controlplane.urls"))]


@pytest.mark.urls(__name__)
def test_a_server_error_is_a_500_inside_the_layout_with_a_way_out(client, world):
    client.raise_request_exception = False
    client.force_login(world.operator)
    response = client.get("/fails/")
    page = response.content.decode()
    assert response.status_code == 500 and 'id="server-error"' in page and 'href="/"' in page
    assert "a bug" not in page and "Traceback" not in page
