from django.urls import path, re_path

from controlplane.gateway import views

app_name = "gateway"
urlpatterns = [
    path("models", views.models, name="models"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    re_path(r"^(?P<path>.*)$", views.not_found),
]
