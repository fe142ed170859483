"""The playground page: what it needs to talk to the public APIs with a key (the browser test
drives it end to end)."""

import pytest

pytestmark = pytest.mark.django_db


def test_operators_and_tenant_admins_open_it_and_strangers_are_sent_to_log_in(client, world):
    assert client.get("/playground/").status_code == 302
    for user in (world.operator, world.alice_admin):
        client.force_login(user)
        page = client.get("/playground/").content.decode()
        assert 'id="pg-key"' in page and 'id="pg-image"' in page and "js/playground" in page
        # The answer links to the request log, where the request's figures are.
        assert 'data-requests="/requests/"' in page
