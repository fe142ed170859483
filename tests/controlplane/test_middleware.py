from django.conf import settings
from django.utils.module_loading import import_string


def test_every_middleware_is_async_capable_so_the_gateway_serves_requests_concurrently():
    # One sync-only middleware makes Django push every request through a single thread.
    sync_only = [path for path in settings.MIDDLEWARE if not getattr(import_string(path), "async_capable", False)]
    assert sync_only == []


def test_static_files_are_still_served(client):
    response = client.get("/static/css/app.css")
    assert response.status_code == 200
    assert b".card" in b"".join(response.streaming_content)
