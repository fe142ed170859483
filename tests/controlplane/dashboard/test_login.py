"""Logging in to the product pages: wrong or impossible credentials are refused alike, and
the admin of a deactivated tenant is refused with the reason, now and on their next request."""

from __future__ import annotations

import html

import pytest

from tests.pages import field_errors

pytestmark = pytest.mark.django_db


def _deactivate(tenant):
    tenant.active = False
    tenant.save()


def test_a_username_longer_than_any_user_is_refused_like_a_wrong_password(client, world):
    page = client.post("/login/", {"username": "x" * 300, "password": "password"})
    assert page.status_code == 200
    assert "didn't match" in html.unescape(page.content.decode())


def test_the_admin_of_a_deactivated_tenant_cannot_log_in_and_is_told_why(client, world):
    _deactivate(world.alice)
    page = client.post("/login/", {"username": "alice-admin", "password": "password"})
    assert page.status_code == 200
    assert "alice is deactivated" in page.content.decode()
    assert client.get("/account/")["Location"].startswith("/login/")


def test_a_deactivated_tenants_admin_is_signed_out_on_their_next_request(client, world):
    client.force_login(world.alice_admin)
    assert client.get("/account/").status_code == 200
    _deactivate(world.alice)
    page = client.get("/account/", follow=True)
    assert page.redirect_chain[-1][0].startswith("/login/")
    assert "alice is deactivated" in page.content.decode()
    assert client.get("/requests/")["Location"].startswith("/login/")  # the session is gone


def test_a_deactivated_tenants_admin_calling_the_api_is_refused_and_signed_out(client, world):
    client.force_login(world.alice_admin)
    _deactivate(world.alice)
    refused = client.get("/api/v1/usage/requests/")
    assert refused.status_code == 403 and "alice is deactivated" in refused.json()["detail"]
    assert client.get("/api/v1/usage/requests/").status_code == 401


def test_a_deactivated_tenants_admin_can_log_in_again_once_it_is_reactivated(client, world):
    _deactivate(world.alice)
    world.alice.active = True
    world.alice.save()
    assert client.post("/login/", {"username": "alice-admin", "password": "password"}).status_code == 302
    assert client.get("/account/").status_code == 200


def test_staff_and_other_tenants_admins_are_not_signed_out(client, world):
    _deactivate(world.alice)
    for user in (world.operator, world.finance, world.charlie_admin):
        client.force_login(user)
        assert client.get("/requests/").status_code == 200
    assert not field_errors(client.get("/requests/").content.decode())


def test_the_sign_out_is_made_on_the_asynchronous_path_too(async_client, world):
    from asgiref.sync import async_to_sync, sync_to_async

    async def visits():
        await async_client.aforce_login(world.operator)
        staff = await async_client.get("/requests/")
        await async_client.aforce_login(world.alice_admin)
        await sync_to_async(_deactivate)(world.alice)
        return staff, await async_client.get("/account/")

    staff, admin = async_to_sync(visits)()
    assert staff.status_code == 200
    assert admin.status_code == 302 and admin["Location"].startswith("/login/")
