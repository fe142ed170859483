"""The OpenAPI schema and its interactive docs."""

import pytest

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("version", ["2", "0.1.0\r\nX-Injected: yes", "x" * 300])
def test_a_version_the_api_does_not_have_is_a_400_naming_the_one_it_has(client, version):
    response = client.get("/api/schema/", {"version": version})
    assert response.status_code == 400
    assert "the API has one version, 0.1.0" in response.content.decode()


@pytest.mark.parametrize("query", [{}, {"version": "0.1.0"}])
def test_the_schema_is_served_without_a_version_or_with_its_own(client, query):
    response = client.get("/api/schema/", query)
    assert response.status_code == 200
    assert b"/api/v1/usage/requests/" in response.content
