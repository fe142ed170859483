"""Operators invite users with a role (operator, finance, admin of a tenant), change roles and
deactivate them in product pages; the invited user sets a password through a one-time link."""

from __future__ import annotations

import html

import pytest
from django.contrib.auth import get_user_model

from controlplane.audit.models import AuditEntry
from controlplane.tenants import roles

pytestmark = pytest.mark.django_db


def _invite(client, world, **fields):
    response = client.post("/users/", {"username": "petra", "email": "petra@example.com", **fields}, follow=True)
    page = response.content.decode()
    return page, html.unescape(page.split('id="invitation-link">')[1].split("<")[0]) if "invitation-link" in page else None


def test_an_invited_tenant_admin_sets_a_password_and_sees_only_its_tenant(client, world):
    client.force_login(world.operator)
    page, link = _invite(client, world, role=f"tenant:{world.alice.pk}")
    petra = get_user_model().objects.get(username="petra")
    assert roles.member_tenant(petra) == world.alice and not petra.has_usable_password() and not petra.is_staff
    assert AuditEntry.objects.filter(object_type="user", action="created", actor=world.operator.username).exists()
    client.logout()
    form = client.get(link, follow=True)  # Django moves the token into the session, then shows the form
    assert "Set your password" in form.content.decode()
    done = client.post(form.redirect_chain[-1][0], {"new_password1": "a-long-pass-phrase-9", "new_password2":
                                                    "a-long-pass-phrase-9"}, follow=True)
    assert "Your password is set" in done.content.decode()
    assert "This link no longer works" in client.get(link, follow=True).content.decode()  # used once
    logged_in = client.post("/login/", {"username": "petra", "password": "a-long-pass-phrase-9"})
    assert logged_in.status_code == 302
    assert client.get("/tenants/").status_code == 403
    assert "Statement of alice" in client.get("/statements/").content.decode()


def test_an_operator_changes_a_role_and_deactivates_a_user(client, world):
    client.force_login(world.operator)
    _invite(client, world, role="finance")
    petra = get_user_model().objects.get(username="petra")
    assert roles.is_finance(petra)
    client.post(f"/users/{petra.pk}/", {"role": "operator", "active": "on"})
    petra = get_user_model().objects.get(pk=petra.pk)
    assert roles.is_operator(petra) and not roles.is_finance(petra)
    client.post(f"/users/{petra.pk}/", {"role": "operator"})  # active unticked
    petra.refresh_from_db()
    assert not petra.is_active
    row = client.get("/users/").content.decode().split('data-user="petra"')[1].split("</tr>")[0]
    assert "deactivated" in row
    change = AuditEntry.objects.filter(object_type="user", action="changed").first()
    assert change.changes == {"active": [True, False]}


def test_a_role_must_be_chosen_and_names_are_unique_and_an_operator_cannot_lock_itself_out(client, world):
    client.force_login(world.operator)
    page, _ = _invite(client, world, role="")
    assert "This field is required." in page
    page, _ = _invite(client, world, role="finance", username=world.finance.username.upper())
    assert "a user with that name exists" in page
    page = client.post(f"/users/{world.operator.pk}/", {"role": "finance", "active": "on"}, follow=True)
    assert "cannot deactivate yourself or give up your own operator role" in html.unescape(page.content.decode())
    assert roles.is_operator(get_user_model().objects.get(pk=world.operator.pk))


def test_only_operators_manage_users(client, world):
    client.force_login(world.finance)
    assert client.get("/users/").status_code == 403
    assert client.post("/users/", {"username": "x", "role": "operator"}).status_code == 403
