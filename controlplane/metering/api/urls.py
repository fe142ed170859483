from django.urls import path

from controlplane.metering.api import account, views

urlpatterns = [
    path("usage/requests/", views.UsageRequestList.as_view(), name="usage-requests"),
    path("usage/hourly/", views.HourlyUsageList.as_view(), name="usage-hourly"),
    path("usage/daily/", views.DailyUsageList.as_view(), name="usage-daily"),
    path("usage/by-tier/", views.TierUsageList.as_view(), name="usage-by-tier"),
    path("quota/", account.QuotaStatus.as_view(), name="quota"),
    path("cost/", account.CostToDate.as_view(), name="cost"),
    path("estimate/", account.Estimate.as_view(), name="estimate"),
    path("statements/<str:period>/", account.Statement.as_view(), name="statement"),
]
