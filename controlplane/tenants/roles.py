"""Who may see and do what. Operator: everything. Finance: usage and exports, read only.
Tenant admin: their own tenant only, while it is active."""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission
from django.db.models import QuerySet

from controlplane.tenants.models import Tenant

OPERATOR = "operator"
FINANCE = "finance"


def _in_group(user, name: str) -> bool:
    if not getattr(user, "is_authenticated", False) or not hasattr(user, "groups"):
        return False
    cache = getattr(user, "_role_groups", None)
    if cache is None:  # through the relation: a page of many users prefetches their groups
        cache = {group.name for group in user.groups.all()}
        user._role_groups = cache
    return name in cache


def is_operator(user) -> bool:
    return bool(getattr(user, "is_superuser", False)) or _in_group(user, OPERATOR)


def is_finance(user) -> bool:
    return _in_group(user, FINANCE)


def membership_tenant(user):
    """The tenant `user` is made the admin of, active or not."""
    membership = getattr(user, "membership", None) if getattr(user, "pk", None) else None
    return membership.tenant if membership is not None else None


def member_tenant(user):
    """The tenant `user` acts for: the one they are the admin of, while it is active."""
    tenant = membership_tenant(user)
    return tenant if tenant is not None and tenant.active else None


def deactivated_tenant(user):
    """The deactivated tenant `user` is the admin of, if so: they may not log in, and a
    session of theirs ends at its next request."""
    tenant = membership_tenant(user)
    return tenant if tenant is not None and not tenant.active else None


def sees_every_tenant(user) -> bool:
    return is_operator(user) or is_finance(user)


def can_see_usage(user) -> bool:
    return sees_every_tenant(user) or member_tenant(user) is not None


def visible_tenants(user) -> QuerySet:
    if sees_every_tenant(user):
        return Tenant.objects.all()
    tenant = member_tenant(user)
    if tenant is None:
        return Tenant.objects.none()
    return Tenant.objects.filter(pk=tenant.pk)


FINANCE_VIEWS = ("metering", "catalog", "tenants")


def roles_sync(**_kwargs) -> None:
    """Give the role groups their admin permissions (run after every migrate).

    Operators may do everything; finance may view usage, prices and tenants, and change
    nothing. Tenant admins have no admin access at all.
    """
    operator, _ = Group.objects.get_or_create(name=OPERATOR)
    operator.permissions.set(Permission.objects.all())
    finance, _ = Group.objects.get_or_create(name=FINANCE)
    finance.permissions.set(Permission.objects.filter(
        codename__startswith="view_", content_type__app_label__in=FINANCE_VIEWS))
