"""Logging in to the product pages."""

from __future__ import annotations

from django.contrib.auth.forms import AuthenticationForm
from django.core.validators import MaxLengthValidator

INVALID_LOGIN = "Your username and password didn't match. Please try again."


class LoginForm(AuthenticationForm):
    """Django's login form, refusing a username no user can have before it is looked up:
    Django sets the field's max_length without its validator, and a failed login of a name
    past 255 characters was a 500 where django-axes records it."""

    error_messages = {**AuthenticationForm.error_messages, "invalid_login": INVALID_LOGIN}

    def __init__(self, request=None, *args, **kwargs):
        super().__init__(request, *args, **kwargs)
        self.fields["username"].validators.append(MaxLengthValidator(self.fields["username"].max_length))

    def clean(self):
        if self.has_error("username"):
            raise self.get_invalid_login_error()
        return super().clean()
