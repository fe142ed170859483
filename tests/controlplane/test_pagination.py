"""Every list of the API pages the same way, and a page it cannot turn to is a 400."""

import pytest

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("url", ["/api/v1/benchmarks/profiles/", "/api/v1/benchmarks/runs/",
                                 "/api/v1/benchmarks/eval-sets/"])
@pytest.mark.parametrize("query, named", [
    ({"limit": "9" * 30}, "limit"), ({"offset": "9" * 30}, "offset"), ({"limit": "-1"}, "limit"),
    ({"offset": "١٢"}, "offset"), ({"limit": "0"}, "limit"),
])
def test_a_page_past_any_number_is_a_400_naming_its_parameter(client, world, url, query, named):
    client.force_login(world.operator)
    response = client.get(url, query)
    assert response.status_code == 400
    assert named in response.json()


def test_a_list_pages_within_its_largest_page(client, world):
    client.force_login(world.operator)
    page = client.get("/api/v1/benchmarks/runs/", {"limit": "5000", "offset": "0"}).json()
    assert page["count"] == 0 and page["results"] == []
