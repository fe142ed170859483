from __future__ import annotations

import datetime as dt
import re

import pytest
from django.utils import timezone

from controlplane.metering.models import DailyUsage
from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import api_key_lookup

pytestmark = pytest.mark.django_db


def _usage(tenant, tier, image_tokens, day=None):
    return DailyUsage.objects.create(day=day or timezone.now().date(), tenant=tenant, tier=tier,
                                     requests=1, images=1, image_tokens=image_tokens, cost="0.5")


def test_anonymous_visitors_are_sent_to_login(client):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_the_operator_dashboard_draws_image_tokens_per_day_with_local_plotly(client, world):
    _usage(world.alice, world.vision, 1224)
    client.force_login(world.operator)
    page = client.get("/usage/").content.decode()
    assert 'id="image-tokens-chart"' in page
    # Its hashed name once collectstatic has run (runlocal runs it), its plain name before.
    (script,) = re.findall(r'<script src="(/static/vendor/plotly-basic\.min(?:\.[0-9a-f]{12})?\.js)">', page)
    # no script from elsewhere (not "cdn" anywhere: a random CSRF token can spell it)
    assert not re.search(r'<script[^>]*src="(https?:)?//', page) and "cdn.plot.ly" not in page
    assert "1224" in page
    assert client.get(script).status_code == 200


def test_the_dashboard_also_draws_cost_per_day_by_tier(client, world):
    _usage(world.alice, world.vision, 1224)
    client.force_login(world.operator)
    page = client.get("/usage/").content.decode()
    assert 'id="cost-chart"' in page and "Cost per day (USD)" in page


def test_a_tenant_admin_sees_only_their_own_tenants_figures(client, world):
    _usage(world.alice, world.vision, 777_001)
    _usage(world.charlie, world.vision, 333_002)
    client.force_login(world.charlie_admin)
    page = client.get("/").content.decode()
    assert "333002" in page
    assert "777001" not in page


def test_finance_sees_usage_but_not_the_fleet_or_keys(client, world):
    client.force_login(world.finance)
    assert client.get("/").status_code == 200
    assert client.get("/keys/").status_code == 403
    assert client.get("/fleet/").status_code == 403
    assert client.get("/admin/", follow=False).status_code == 302  # not staff


def test_a_user_with_no_role_sees_nothing(client, world):
    from tests.factories import UserFactory

    client.force_login(UserFactory(username="nobody"))
    assert client.get("/").status_code == 403


def test_an_operator_creates_a_key_shown_once_and_revokes_it(client, world):
    client.force_login(world.operator)
    response = client.post("/keys/", {"tenant": world.bob.pk, "name": "ci"})
    assert response.status_code == 302
    page = client.get("/keys/").content.decode()
    secret = page.split('id="issued-key">')[1].split("<")[0]
    assert api_key_lookup(secret).tenant == world.bob
    assert secret not in client.get("/keys/").content.decode()

    created = ApiKey.objects.get(name="ci")
    client.post(f"/keys/{created.pk}/revoke/")
    assert api_key_lookup(secret) is None


def test_the_fleet_page_lists_instances_and_their_events(client, world):
    from controlplane.fleet.models import EngineInstance
    from controlplane.fleet.services import instance_transition

    instance = EngineInstance.objects.create(tier=world.vision)
    instance_transition(instance=instance, to_state="crashed", reason="engine process 42 exited")
    client.force_login(world.operator)
    page = client.get("/fleet/").content.decode()
    assert "engine process 42 exited" in page
    assert "crashed" in page


def test_old_days_fall_outside_the_thirty_day_window(client, world):
    _usage(world.alice, world.vision, 999_123, day=timezone.now().date() - dt.timedelta(days=45))
    client.force_login(world.operator)
    assert "999123" not in client.get("/").content.decode()


def test_a_static_file_no_finder_has_is_found_nowhere():
    # Under DEBUG, WhiteNoise asks the finders for every static URL: an answer of [None]
    # (a finder saying "not here" with None) made it stat a list and answer a 500.
    from django.contrib.staticfiles import finders

    assert not finders.find("css/no-such-file.css")
    assert finders.find("vendor/plotly-basic.min.js").endswith("plotly-basic.min.js")


@pytest.mark.parametrize("expires", ["9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+12:00"])
def test_an_operators_key_expiry_that_cannot_be_written_in_utc_is_a_form_error(client, world, expires):
    client.force_login(world.operator)
    page = client.post("/keys/", {"tenant": world.bob.pk, "name": "forever", "expires_at": expires})
    assert page.status_code == 200
    assert "no moment that far out can be kept" in page.content.decode()
    assert not ApiKey.objects.filter(name="forever").exists()
    assert client.get("/keys/").status_code == 200


def test_the_services_own_traffic_is_shown_apart_from_every_tenants_usage(client, world):
    from controlplane.tenants.services import internal_tenant

    internal = internal_tenant()
    _usage(world.alice, world.vision, 1_000)
    DailyUsage.objects.create(day=timezone.now().date(), tenant=internal, tier=world.vision, requests=40,
                              images=40, image_tokens=90_000, cost="2.5")
    client.force_login(world.operator)
    page = client.get("/usage/").content.decode()
    totals = page.split('id="usage-totals"')[1].split("</div>\n</div>")[0]
    assert "90,000" not in totals and "1,000" in totals  # every client tenant, not the service's own
    note = page.split('id="internal-usage"')[1].split("</p>")[0]
    assert f">{internal.name}</a>: 40 requests, 2.50 USD" in note
    alone = client.get("/usage/", {"tenant": internal.name}).content.decode()
    assert "90,000" in alone.split('id="usage-totals"')[1].split("</div>\n</div>")[0]
    spenders = client.get("/").content.decode().split('id="top-spenders"')[1].split("</section>")[0]
    assert "alice" in spenders and internal.name not in spenders  # 0.5 USD today is top; 2.5 is not a client's
