from django.urls import path

from controlplane.benchmarks import curve_views, gate_views, views

app_name = "benchmarks"
urlpatterns = [
    path("", views.profile_list, name="list"),
    path("new/", views.profile_edit, name="profile-new"),
    path("from-traffic/", views.profile_from_traffic, name="profile-from-traffic"),
    path("<int:pk>/", views.profile_edit, name="profile"),
    path("<int:pk>/delete/", views.profile_delete, name="profile-delete"),
    path("<int:pk>/run/", views.profile_run, name="profile-run"),
    path("<int:pk>/images/", views.image_upload, name="image-upload"),
    path("<int:pk>/images/<int:image_pk>/delete/", views.image_delete, name="image-delete"),
    path("runs/<int:pk>/", views.run_detail, name="run"),
    path("runs/<int:pk>/cancel/", views.run_cancel, name="run-cancel"),
    path("runs/<int:pk>/advice/apply/", curve_views.run_advice_apply, name="run-advice-apply"),
    path("runs/<int:pk>/curve.csv", curve_views.run_curve_csv, name="run-curve-csv"),
    path("runs/<int:pk>/answers.csv", curve_views.run_answers_csv, name="run-answers-csv"),
    path("compare/", views.compare, name="compare"),
    path("sets/", views.evalset_list, name="evalsets"),
    path("sets/generate/", views.evalset_generate, name="evalset-generate"),
    path("sets/import/", views.evalset_import, name="evalset-import"),
    path("sets/imports/<int:pk>/", views.evalimport_detail, name="evalimport"),
    path("sets/<int:pk>/", views.evalset_detail, name="evalset"),
    path("sets/<int:pk>/delete/", views.evalset_delete, name="evalset-delete"),
    path("sets/<int:pk>/items/", views.evalitem_add, name="evalitem-add"),
    path("sets/<int:pk>/items/<int:item_pk>/image/", views.evalitem_image, name="evalitem-image"),
    path("sets/<int:pk>/items/<int:item_pk>/delete/", views.evalitem_delete, name="evalitem-delete"),
    path("gates/", gate_views.gate_list, name="gates"),
    path("gates/<int:pk>/delete/", gate_views.gate_delete, name="gate-delete"),
    path("gates/checks/<int:pk>/", gate_views.check_detail, name="gate-check"),
    path("gates/checks/<int:pk>/apply/", gate_views.check_apply, name="gate-check-apply"),
    path("gates/checks/<int:pk>/discard/", gate_views.check_discard, name="gate-check-discard"),
]
