"""Users and roles for operators: invite (with a link to set a password), change a role,
deactivate. Nobody needs Django admin for it."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse_lazy

from controlplane.audit.services import history
from controlplane.tenants import roles
from controlplane.tenants.forms import UserChangeForm, UserInviteForm, role_value
from controlplane.tenants.users import Role, invitation_path, user_change, user_invite
from controlplane.web.access import operators_only


@login_required
def user_list(request):
    operators_only(request)
    form = UserInviteForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = user_invite(username=form.cleaned_data["username"], email=form.cleaned_data["email"],
                           role=form.cleaned_data["role"], actor=request.user.get_username())
        request.session["invitation"] = [user.username, request.build_absolute_uri(invitation_path(user))]
        return redirect("dashboard:users")
    people = list(get_user_model().objects.order_by("username").select_related("membership__tenant")
                  .prefetch_related("groups"))
    for person in people:
        person.role = Role.of(person)
    return render(request, "tenants/users.html", {
        "form": form, "people": people, "invitation": request.session.pop("invitation", None),
        "invite_days": settings.PASSWORD_RESET_TIMEOUT // 86400})


@login_required
def user_edit(request, pk: int):
    operators_only(request)
    person = get_object_or_404(get_user_model(), pk=pk)
    initial = {"role": role_value(Role.of(person)), "active": person.is_active}
    form = UserChangeForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        role, active = form.cleaned_data["role"], form.cleaned_data["active"]
        if person == request.user and (not active or role.name != roles.OPERATOR):
            messages.error(request, "You cannot deactivate yourself or give up your own operator role: "
                                    "ask another operator.")
        else:
            user_change(user=person, role=role, active=active, actor=request.user.get_username())
            messages.success(request, f"{person.username} is now {role}{'' if active else ', deactivated'}.")
            return redirect("dashboard:users")
    invite = None
    if request.method == "POST" and "reinvite" in request.POST and person.is_active and not person.has_usable_password():
        invite = request.build_absolute_uri(invitation_path(person))
    return render(request, "tenants/user_form.html", {"form": form, "person": person, "invite": invite,
                                                        "history": history(person)[:20]})


class Invitation(auth_views.PasswordResetConfirmView):
    """An invited user sets their password, once, through the link they were given."""

    template_name = "registration/invitation.html"
    success_url = reverse_lazy("login")

    def form_valid(self, form):
        response = super().form_valid(form)
        messages.success(self.request, "Your password is set: log in with it.")
        return response
