from django.urls import path

from controlplane.metering.api import exports

urlpatterns = [
    path("images.<str:filetype>", exports.ImageCostExport.as_view(), name="api-export-images"),
    path("monthly-summary.<str:filetype>", exports.MonthlySummaryExport.as_view(), name="api-export-monthly-summary"),
]
