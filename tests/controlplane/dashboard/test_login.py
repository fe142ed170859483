"""Logging in to the product pages: wrong or impossible credentials are refused alike."""

from __future__ import annotations

import html

import pytest

pytestmark = pytest.mark.django_db


def test_a_username_longer_than_any_user_is_refused_like_a_wrong_password(client, world):
    page = client.post("/login/", {"username": "x" * 300, "password": "password"})
    assert page.status_code == 200
    assert "didn't match" in html.unescape(page.content.decode())
