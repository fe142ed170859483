from django.urls import path

from controlplane.metering.api import views

urlpatterns = [
    path("usage/requests/", views.UsageRequestList.as_view(), name="usage-requests"),
    path("usage/daily/", views.DailyUsageList.as_view(), name="usage-daily"),
]
