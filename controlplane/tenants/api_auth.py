from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from controlplane.tenants.services import api_key_lookup


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer <key>` for the tenant metering API. request.auth is the ApiKey."""

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header.lower().startswith("bearer "):
            return None
        api_key = api_key_lookup(header[7:].strip())
        if api_key is None:
            raise exceptions.AuthenticationFailed("invalid, expired or revoked API key")
        return (TenantPrincipal(api_key.tenant), api_key)

    def authenticate_header(self, request):
        return "Bearer"


class TenantPrincipal:
    """Stands in for request.user when a tenant calls with an API key."""

    is_authenticated = True
    is_active = True
    is_staff = False
    is_superuser = False

    def __init__(self, tenant):
        self.tenant = tenant
        self.pk = None

    def __str__(self):
        return f"tenant:{self.tenant.name}"


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """Tells the OpenAPI schema (and its interactive docs) how tenants authenticate."""

    target_class = ApiKeyAuthentication
    name = "tenantApiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": "A tenant API key: `Authorization: Bearer vlm-…`"}
