"""403 and 404 pages are product pages: inside the layout, saying why, with a way out."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

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
