from django.utils.functional import SimpleLazyObject

from controlplane.alerts.selectors import alerts_firing_count
from controlplane.tenants import roles as _roles


def roles(request):
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    operator = _roles.is_operator(user)
    context = {
        "is_operator": operator,
        "is_finance": _roles.is_finance(user),
        "member_tenant": _roles.member_tenant(user),
    }
    if operator:
        # The nav's badge: one count, made only when a page renders the nav.
        context["firing_alerts"] = SimpleLazyObject(alerts_firing_count)
    return context
