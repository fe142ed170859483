"""Bad input to the finance exports and the usage lists is a 400, never a server error, and
the totals they give agree with the events behind them."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("url", ["/exports/images.csv", "/exports/monthly-summary.xlsx"])
def test_a_tenant_name_with_a_nul_character_is_a_bad_request_on_the_dashboard(client, world, url):
    client.force_login(world.finance)
    response = client.get(url, {"tenant": "ali\x00ce"})
    assert response.status_code == 400


@pytest.mark.parametrize("url", ["/api/v1/exports/images.csv", "/api/v1/exports/monthly-summary.csv"])
def test_a_tenant_name_with_a_nul_character_is_a_bad_request_over_the_api(client, world, url):
    client.force_login(world.finance)
    response = client.get(url, {"tenant": "ali\x00ce"})
    assert response.status_code == 400
