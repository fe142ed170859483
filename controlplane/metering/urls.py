"""The metering pages: the request log, statements and exports. The dashboard mounts them at
the site's root, in its URL namespace (`dashboard:requests`, ...); the metering API has its
own (api/)."""

from django.urls import path

from controlplane.metering.views import exports, requests, statements

urlpatterns = [
    path("requests/", requests.request_log, name="requests"),
    path("requests/<str:request_id>/", requests.request_detail, name="request"),
    path("statements/", statements.statements, name="statements"),
    path("statements/<slug:tenant>/<str:month>.pdf", statements.invoice, name="invoice"),
    path("exports/", exports.exports, name="exports"),
    path("exports/<slug:report>.<str:filetype>", exports.download, name="export"),
]
