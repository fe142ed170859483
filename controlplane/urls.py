from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularSwaggerView

from controlplane.metrics import metrics
from controlplane.schema import SchemaView
from controlplane.tenants.forms import LoginForm
from controlplane.tenants.views.users import Invitation

urlpatterns = [
    path("v1/", include("controlplane.gateway.urls")),
    path("api/v1/exports/", include("controlplane.metering.api.export_urls")),
    path("api/v1/", include("controlplane.metering.api.urls")),
    path("api/v1/benchmarks/", include("controlplane.benchmarks.api.urls")),
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("metrics", metrics, name="metrics"),
    path("admin/", admin.site.urls),
    path("login/", auth_views.LoginView.as_view(authentication_form=LoginForm), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("invitation/<uidb64>/<token>/", Invitation.as_view(), name="invitation"),
    path("benchmarks/", include("controlplane.benchmarks.urls")),
    path("", include("controlplane.dashboard.urls")),
]
