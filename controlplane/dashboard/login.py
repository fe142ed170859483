"""Logging in to the product pages."""

from __future__ import annotations

from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.core.validators import MaxLengthValidator

from controlplane.tenants import roles

INVALID_LOGIN = "Your username and password didn't match. Please try again."
TENANT_DEACTIVATED = "{tenant} is deactivated: its admins cannot log in until an operator reactivates it."


class LoginForm(AuthenticationForm):
    """Django's login form, refusing a username no user can have before it is looked up
    (Django sets the field's max_length without its validator, and a failed login of a name
    past 255 characters was a 500 where django-axes records it), and the admin of a
    deactivated tenant, saying why."""

    error_messages = {**AuthenticationForm.error_messages, "invalid_login": INVALID_LOGIN}

    def __init__(self, request=None, *args, **kwargs):
        super().__init__(request, *args, **kwargs)
        self.fields["username"].validators.append(MaxLengthValidator(self.fields["username"].max_length))

    def clean(self):
        if self.has_error("username"):
            raise self.get_invalid_login_error()
        return super().clean()

    def confirm_login_allowed(self, user):
        super().confirm_login_allowed(user)
        tenant = roles.deactivated_tenant(user)
        if tenant is not None:
            raise ValidationError(TENANT_DEACTIVATED.format(tenant=tenant.name), code="tenant_deactivated")
