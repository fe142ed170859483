from controlplane.tenants import roles as _roles


def roles(request):
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {
        "is_operator": _roles.is_operator(user),
        "is_finance": _roles.is_finance(user),
        "member_tenant": _roles.member_tenant(user),
    }
