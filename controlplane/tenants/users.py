"""People who log in, and their roles: operator, finance, or the admin of one tenant. Created
by an operator with an invitation link (the user sets their own password), deactivated rather
than deleted, every change recorded with who made it."""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.auth.tokens import default_token_generator
from django.db import transaction
from django.urls import reverse
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.tenants import roles
from controlplane.tenants.models import Membership, Tenant

TENANT_ADMIN = "tenant"
ROLES = {roles.OPERATOR: "Operator", roles.FINANCE: "Finance", TENANT_ADMIN: "Tenant admin"}


@dataclass(frozen=True)
class Role:
    name: str  # operator, finance, tenant
    tenant: Tenant | None = None

    def __str__(self):
        return f"admin of {self.tenant.name}" if self.name == TENANT_ADMIN else self.name

    @classmethod
    def of(cls, user) -> Role | None:
        if roles.is_operator(user):
            return cls(roles.OPERATOR)
        if roles.is_finance(user):
            return cls(roles.FINANCE)
        tenant = roles.membership_tenant(user)  # a deactivated tenant's admin keeps their role
        return cls(TENANT_ADMIN, tenant) if tenant is not None else None


def invitation_path(user) -> str:
    """Where `user` sets their password (Django's reset token: one use, expires after
    PASSWORD_RESET_TIMEOUT, void once the password changes)."""
    return reverse("invitation", kwargs={"uidb64": urlsafe_base64_encode(force_bytes(user.pk)),
                                         "token": default_token_generator.make_token(user)})


@transaction.atomic
def user_invite(*, username: str, email: str, role: Role, actor: str):
    user = get_user_model().objects.create_user(username=username, email=email)  # no password until set
    _role_set(user, role)
    audit_record(actor=actor, action=AuditEntry.Action.CREATED, obj=user,
                 after={"username": username, "email": email, "role": str(role), "active": True})
    return user


@transaction.atomic
def user_change(*, user, role: Role, active: bool, actor: str) -> None:
    before = {"role": str(Role.of(user) or "none"), "active": user.is_active}
    _role_set(user, role)
    user.is_active = active
    user.save(update_fields=["is_active"])
    audit_record(actor=actor, action=AuditEntry.Action.CHANGED, obj=user, before=before,
                 after={"role": str(role), "active": active})


def _role_set(user, role: Role) -> None:
    user.groups.remove(*Group.objects.filter(name__in=(roles.OPERATOR, roles.FINANCE)))
    Membership.objects.filter(user=user).delete()
    if role.name in (roles.OPERATOR, roles.FINANCE):
        group, _ = Group.objects.get_or_create(name=role.name)
        user.groups.add(group)
    else:
        Membership.objects.create(user=user, tenant=role.tenant)
    user.is_staff = False  # nobody works in Django admin
    user.save(update_fields=["is_staff"])
    user.__dict__.pop("_role_groups", None)
