"""Who may open the product pages: one check per role, shared by every page."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied

from controlplane.tenants import roles


def operators_only(request) -> None:
    if not roles.is_operator(request.user):
        raise PermissionDenied


def staff_only(request, *, change: bool = False) -> None:
    """Operators; finance too when only reading."""
    if not (roles.is_operator(request.user) or (not change and roles.is_finance(request.user))):
        raise PermissionDenied
