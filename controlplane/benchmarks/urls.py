from django.urls import path

from controlplane.benchmarks import views

app_name = "benchmarks"
urlpatterns = [
    path("", views.profile_list, name="list"),
    path("new/", views.profile_edit, name="profile-new"),
    path("<int:pk>/", views.profile_edit, name="profile"),
    path("<int:pk>/delete/", views.profile_delete, name="profile-delete"),
    path("<int:pk>/run/", views.profile_run, name="profile-run"),
    path("<int:pk>/images/", views.image_upload, name="image-upload"),
    path("<int:pk>/images/<int:image_pk>/delete/", views.image_delete, name="image-delete"),
    path("<int:pk>/eval/", views.eval_item_add, name="eval-add"),
    path("<int:pk>/eval/<int:item_pk>/delete/", views.eval_item_delete, name="eval-delete"),
    path("runs/<int:pk>/", views.run_detail, name="run"),
    path("runs/<int:pk>/cancel/", views.run_cancel, name="run-cancel"),
    path("compare/", views.compare, name="compare"),
]
