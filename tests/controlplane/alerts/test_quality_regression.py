"""A tier's accuracy falling between two resolution sweeps: the latest sweep that succeeded in the
window against the one before it on the same profile and set, cap by cap; it fires when the set's
accuracy fell by the threshold at a cap and the two intervals say the fall is real."""

from __future__ import annotations

import pytest

from controlplane.alerts.models import Alert, AlertRule
from controlplane.alerts.services import alerts_evaluate
from controlplane.audit.models import AuditEntry
from tests.controlplane.alerts.conftest import later
from tests.controlplane.benchmarks.runs import make_profile, sweep
from tests.factories import VisionTierFactory

pytestmark = pytest.mark.django_db

GOOD = ((200_704, 0.70, [0.61, 0.78], "0.000039"), (1_003_520, 0.88, [0.80, 0.93], "0.000192"))
# 1,003,520 px fell 18 points, measurably; 200,704 px fell 2, within the noise.
FALLEN = ((200_704, 0.68, [0.59, 0.76], "0.000039"), (1_003_520, 0.70, [0.61, 0.78], "0.000192"))
# Fell 10 points at 1,003,520 px, but the intervals overlap.
NOISY = ((200_704, 0.70, [0.61, 0.78], "0.000039"), (1_003_520, 0.78, [0.60, 0.90], "0.000192"))


def firing():
    return list(Alert.objects.filter(state="firing").select_related("rule"))


@pytest.fixture
def profile(world):
    return make_profile(world.vision, name="nightly", kind="resolution")


def run_at(profile, curve, at, **fields):
    return sweep(profile, curve, finished_at=at, **fields)


def test_it_fires_when_accuracy_falls_measurably_at_a_cap_and_clears_when_a_sweep_recovers(world, only_rule, now,
                                                                                            profile):
    only_rule(kind="quality_regression", threshold=5, window_minutes=24 * 60, tier=world.vision)
    before = run_at(profile, GOOD, later(now, hours=-25))
    latest = run_at(profile, FALLEN, later(now, minutes=-5), trigger="schedule")
    assert alerts_evaluate(now=now).fired == 1
    [alert] = firing()
    assert alert.subject == "profile:nightly" and alert.value == 18
    assert alert.message == (
        f"vlm-lite (sweep nightly on receipts): accuracy fell 18.0 points at 1,003,520 px, 70.0% [61.0%, 78.0%] in "
        f"run #{latest.pk} against 88.0% [80.0%, 93.0%] in run #{before.pk}; the intervals do not overlap")
    assert alerts_evaluate(now=later(now, minutes=1)).fired == 0  # once per episode

    run_at(profile, GOOD, later(now, minutes=30))
    assert alerts_evaluate(now=later(now, minutes=31)).resolved == 1
    alert.refresh_from_db()
    assert alert.state == "resolved" and alert.resolution.startswith("cleared: vlm-lite (sweep nightly on receipts)")
    assert "18.0 points" in alert.resolution or "no cap lost accuracy" in alert.resolution


def test_a_fall_within_the_noise_of_the_set_does_not_fire_and_says_why(world, only_rule, now, profile):
    rule = only_rule(kind="quality_regression", threshold=5, window_minutes=60)
    run_at(profile, GOOD, later(now, hours=-2))
    run_at(profile, NOISY, later(now, minutes=-5))
    assert alerts_evaluate(now=now).fired == 0
    from controlplane.alerts.conditions import readings

    reading = readings(rule=rule, now=now)["profile:nightly"]
    assert not reading.breached and reading.value == 10
    assert "fell 10.0 points at 1,003,520 px" in reading.message and "the intervals overlap" in reading.message


def test_a_fall_below_the_threshold_does_not_fire(world, only_rule, now, profile):
    only_rule(kind="quality_regression", threshold=20, window_minutes=60)
    run_at(profile, GOOD, later(now, hours=-2))
    run_at(profile, FALLEN, later(now, minutes=-5))
    assert alerts_evaluate(now=now).fired == 0


def test_only_sweeps_of_the_same_set_and_caps_both_measured_are_compared(world, only_rule, now, profile):
    only_rule(kind="quality_regression", threshold=5, window_minutes=60)
    run_at(profile, GOOD, later(now, hours=-3))
    other_set = run_at(profile, ((1_003_520, 0.99, [0.97, 1.0], "0.000192"),), later(now, hours=-2))
    other_set.config["eval_set"] = "charts"
    other_set.save()
    run_at(profile, ((1_003_520, 0.99, [0.97, 1.0], "0.000192"),), later(now, hours=-1), state="failed")
    run_at(profile, FALLEN[:1] + ((401_408, 0.1, [0.05, 0.2], "0.0001"),), later(now, minutes=-5))
    # Against the sweep of its own set (not the later one on charts, nor the failed one): at
    # 200,704 px it fell 2 points; 401,408 px was not measured before.
    assert alerts_evaluate(now=now).fired == 0
    run_at(profile, FALLEN, later(now, minutes=-1))  # against the one before it: 18 points at 1,003,520 px
    assert alerts_evaluate(now=now).fired == 0  # that one had no 1,003,520 px cap
    run_at(profile, GOOD, later(now, minutes=1))
    run_at(profile, FALLEN, later(now, minutes=2))
    assert alerts_evaluate(now=later(now, minutes=3)).fired == 1


def test_a_rule_for_one_tier_watches_that_tier_s_sweeps_alone(world, only_rule, now, profile):
    pro = VisionTierFactory(name="vlm-pro")
    elsewhere = make_profile(pro, name="pro-nightly", kind="resolution")
    for watched in (profile, elsewhere):
        run_at(watched, GOOD, later(now, hours=-2))
        run_at(watched, FALLEN, later(now, minutes=-5))
    only_rule(kind="quality_regression", threshold=5, window_minutes=60, tier=pro)
    alerts_evaluate(now=now)
    assert [a.subject for a in firing()] == ["profile:pro-nightly"]


def test_a_fall_older_than_the_window_resolves_as_no_longer_seen(world, only_rule, now, profile):
    only_rule(kind="quality_regression", threshold=5, window_minutes=60)
    run_at(profile, GOOD, later(now, hours=-2))
    run_at(profile, FALLEN, later(now, minutes=-5))
    assert alerts_evaluate(now=now).fired == 1
    assert alerts_evaluate(now=later(now, minutes=56)).resolved == 1
    assert Alert.objects.get().resolution.startswith("cleared: no longer seen")


def test_its_threshold_is_points_within_bounds_and_it_scopes_to_tiers_only(world):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError) as refused:
        AlertRule(name="r", kind="quality_regression", threshold=0, tenant=world.alice).full_clean()
    assert refused.value.message_dict["threshold"] == [
        "for a tier's accuracy falling between two resolution sweeps, points of accuracy lost at a cap: "
        "from 0.1 points to 100 points"]
    assert refused.value.message_dict["tenant"] == [
        "a tier's accuracy falling between two resolution sweeps cannot be limited to a tenant"]
    AlertRule(name="r", kind="quality_regression", threshold="2.5", tier=world.vision).full_clean()


def test_a_fresh_install_watches_for_accuracy_falling(world):
    rule = AlertRule.objects.get(kind="quality_regression")
    assert (rule.threshold, rule.window_minutes, rule.tier, rule.enabled) == (5, 7 * 24 * 60, None, True)


def test_an_operator_makes_a_rule_of_the_kind_on_its_page(client, world):
    client.force_login(world.operator)
    response = client.post("/alerts/rules/new/", {
        "name": "Lite accuracy", "kind": "quality_regression", "threshold": "3", "window_minutes": "1440",
        "for_seconds": "120", "min_requests": "20", "tier": world.vision.pk, "enabled": "on"})
    assert response.status_code == 302
    rule = AlertRule.objects.get(name="Lite accuracy")
    assert (rule.kind, rule.threshold, rule.tier) == ("quality_regression", 3, world.vision)
    assert AuditEntry.objects.filter(object_type="alert rule", object_id=str(rule.pk)).exists()
    page = client.get("/alerts/").content.decode()
    row = page.split(f'data-rule="{rule.pk}"')[1].split("</tr>")[0]
    assert "3 points of accuracy lost at a cap" in row and "tier vlm-lite" in row
