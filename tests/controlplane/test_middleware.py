import pytest
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


@pytest.mark.django_db
@pytest.mark.parametrize("user, url", [
    ("operator", "/requests/?q=%00"),
    ("operator", "/audit/?q=a%00b"),
    ("finance", "/exports/images.csv?tenant=alice%00"),
    ("alice_admin", "/statements/?month=2026-01&x=%00"),
    (None, "/login/?next=/%00"),
])
def test_a_nul_byte_in_a_pages_query_string_is_a_400_that_says_so(client, world, user, url):
    if user:
        client.force_login(getattr(world, user))
    response = client.get(url)
    assert response.status_code == 400
    assert "NUL byte (%00)" in response.content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/api/schema/?version=%00", "/api/v1/usage/requests/?tier=vlm-lite%00",
                                 "/api/v1/statements/2026-01/?%00=1"])
def test_a_nul_byte_in_an_api_query_string_is_a_400_in_json(client, world, url):
    response = client.get(url, HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert response.status_code == 400
    assert "NUL byte" in response.json()["detail"]


@pytest.mark.django_db
def test_a_nul_byte_in_a_pages_path_is_a_400(client, world):
    client.force_login(world.operator)
    response = client.get("/requests/req%00one/")
    assert response.status_code == 400
    assert "NUL byte" in response.content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/requests/?q=%ff%fe", "/api/v1/usage/requests/?tier=%c3"])
def test_a_query_string_that_is_not_utf8_is_a_400(client, world, url):
    client.force_login(world.operator)
    response = client.get(url)
    assert response.status_code == 400
    assert "not UTF-8" in response.content.decode()


@pytest.mark.django_db
def test_an_ordinary_query_string_with_escapes_still_reaches_its_page(client, world):
    client.force_login(world.operator)
    assert client.get("/requests/?q=%C3%A9t%C3%A9+%2B1").status_code == 200


def test_the_refusal_is_made_on_the_asynchronous_path_too(async_client):
    from asgiref.sync import async_to_sync

    response = async_to_sync(async_client.get)("/audit/?q=%00")
    assert response.status_code == 400


def test_a_served_schema_with_a_nul_in_its_query_is_answered_not_dropped(serve):
    from controlplane.asgi import Application
    from tests.http_wire import answer, send

    port = serve(Application())
    with send(port, "GET /api/schema/?version=%00 HTTP/1.1\nHost: 127.0.0.1") as client:
        got = answer(client)
    assert got.status == 400 and b"NUL byte" in got.body
