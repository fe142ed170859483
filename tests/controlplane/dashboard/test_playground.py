"""The playground page and the key it talks to the public APIs with, made from the reader's
session (the browser test drives it end to end)."""

import pytest

from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import api_key_lookup

pytestmark = pytest.mark.django_db


def test_operators_and_tenant_admins_open_it_and_strangers_are_sent_to_log_in(client, world):
    assert client.get("/playground/").status_code == 302
    for user in (world.operator, world.alice_admin):
        client.force_login(user)
        page = client.get("/playground/").content.decode()
        assert 'id="pg-tenant"' in page and 'id="pg-image"' in page and "js/playground" in page
        assert 'id="pg-key"' not in page  # no key to paste
        # The answer links to the request log, where the request's figures are.
        assert 'data-requests="/requests/"' in page


def test_an_operators_playground_key_meters_to_the_services_own_tenant_or_the_one_picked(client, world):
    client.force_login(world.operator)
    first = client.post("/playground/key/").json()
    tenant = api_key_lookup(first["key"]).tenant
    assert tenant.internal and first["tenant"] == tenant.name
    assert client.post("/playground/key/").json()["key"] == first["key"]  # one key an hour, kept in the session
    picked = client.post("/playground/key/", {"tenant": "bob"}).json()
    assert api_key_lookup(picked["key"]).tenant == world.bob
    assert ApiKey.objects.filter(name="playground of olivia").count() == 2


def test_a_tenant_admins_playground_key_is_their_tenants_and_no_other(client, world):
    client.force_login(world.alice_admin)
    assert api_key_lookup(client.post("/playground/key/").json()["key"]).tenant == world.alice
    refused = client.post("/playground/key/", {"tenant": "bob"})
    assert refused.status_code == 400 and not ApiKey.objects.filter(tenant=world.bob, name__startswith="playground")
    assert client.get("/playground/key/").status_code == 405
