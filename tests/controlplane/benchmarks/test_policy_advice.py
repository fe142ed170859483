"""The advisor on a resolution run's page: a quality target in, the smallest measured cap
meeting it out, in words and figures, and that cap applied to the tier's policy in one click
(measured first when the tier is gated; audited as the advisor's either way)."""

from __future__ import annotations

import re

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.benchmarks.models import EvalSet, GateCheck, QualityGate
from controlplane.catalog.models import ResolutionPolicy
from tests.controlplane.benchmarks.runs import make_profile, sweep
from tests.factories import VisionTierFactory

pytestmark = pytest.mark.django_db

@pytest.fixture
def run(world):
    return sweep(make_profile(world.vision, kind="resolution"))


def _advise(client, run, kind="within", points="3") -> str:
    return client.get(f"/benchmarks/runs/{run.pk}/", {"target_kind": kind, "target_points": points}).content.decode()


def _stamp(page: str) -> str:
    return re.search(r'name="stamp" value="([0-9a-f]+)"', page).group(1)


def _apply(client, run, page: str, kind="within", points="3", follow=False):
    return client.post(f"/benchmarks/runs/{run.pk}/advice/apply/",
                       {"target_kind": kind, "target_points": points, "stamp": _stamp(page)}, follow=follow)


def _policy(world) -> ResolutionPolicy:
    return ResolutionPolicy.objects.get(pk=world.vision.resolution_policy_id)


def test_it_names_the_smallest_cap_within_the_target_and_what_it_saves(client, world, run):
    client.force_login(world.operator)
    page = _advise(client, run, "within", "3")
    assert ("401,408 px is the smallest cap within 3 points of the best cap: 86.0% (78.0%–91.0%) against 88.0% "
            "at 1,003,520 px; it saves 0.112000 USD per 1,000 images against 1,003,520 px now.") in page
    advice = page.split('id="advice"')[1].split("</table>")[0]
    assert "2.0 points, within the set&#x27;s noise: the two intervals overlap" in advice
    assert "saves 0.112000 USD" in advice
    assert "standard caps images at 1,003,520 px; measured 1,003,520 px: 88.0%" in advice
    assert "Apply 401408 px to standard" in page


def test_a_loss_the_set_can_measure_is_said_to_be_outside_its_noise(client, world, run):
    client.force_login(world.operator)
    page = _advise(client, run, "within", "20")
    advice = page.split('id="advice"')[1].split("</table>")[0]
    assert "200,704 px: 70.0% (61.0%–78.0%)" in advice
    assert "18.0 points, outside the set&#x27;s noise: the two intervals do not overlap" in advice


def test_a_floor_no_cap_reaches_offers_nothing_to_apply(client, world, run):
    client.force_login(world.operator)
    page = _advise(client, run, "at_least", "95")
    assert "No cap meets at least 95 % on the set: the best, 1,003,520 px, scores 88.0%." in page
    assert "Nothing to apply: no measured cap meets the target" in page and 'id="advice-apply"' not in page
    page = _advise(client, run, "at_least", "80")
    assert "401,408 px is the smallest cap at least 80 % on the set" in page


def test_the_cap_in_force_already_chosen_is_not_applied_again(client, world, run):
    client.force_login(world.operator)
    page = _advise(client, run, "within", "0")
    assert "Nothing to apply: the policy standard already caps images at 1,003,520 px" in page


@pytest.mark.parametrize("kind, points, error", [
    ("within", "101", "less than or equal to 100"), ("within", "-1", "greater than or equal to 0"),
    ("within", "nan", "Enter a number"), ("within", "", "This field is required"),
    ("closest", "3", "Select a valid choice"),
])
def test_a_target_out_of_bounds_is_a_form_error_not_advice(client, world, run, kind, points, error):
    client.force_login(world.operator)
    response = client.get(f"/benchmarks/runs/{run.pk}/", {"target_kind": kind, "target_points": points})
    assert response.status_code == 200
    page = response.content.decode()
    assert error in page and 'id="advice-summary"' not in page


def test_applying_saves_the_policy_and_records_that_the_advisor_chose_it(client, world, run):
    ResolutionPolicy.objects.filter(pk=world.vision.resolution_policy_id).update(low_detail_max_pixels=401_408)
    client.force_login(world.operator)
    page = _advise(client, run, "within", "20")
    response = _apply(client, run, page, "within", "20", follow=True)
    policy = _policy(world)
    assert (policy.max_pixels, policy.low_detail_max_pixels) == (200_704, 200_704)
    assert "Policy standard now caps images at 200,704 px." in response.content.decode()
    entry = AuditEntry.objects.get(object_type="resolution policy", object_id=str(policy.pk))
    assert entry.actor == world.operator.username
    assert entry.changes["max_pixels"] == [1_003_520, 200_704]
    assert entry.changes["low_detail_max_pixels"] == [401_408, 200_704]
    assert entry.changes["advisor"] == [
        None, f"from the advisor: run {run.pk}, target within 20 points of the best cap, cap 200,704 px"]
    assert not GateCheck.objects.exists()


def test_a_low_detail_cap_below_the_chosen_one_is_kept(client, world, run):
    client.force_login(world.operator)
    _apply(client, run, _advise(client, run))
    policy = _policy(world)
    assert (policy.max_pixels, policy.low_detail_max_pixels) == (401_408, 200_704)


def test_a_cap_the_policy_cannot_take_is_refused_with_the_policy_s_reason(client, world, run):
    ResolutionPolicy.objects.filter(pk=world.vision.resolution_policy_id).update(min_pixels=300_000,
                                                                                low_detail_max_pixels=401_408)
    client.force_login(world.operator)
    page = _advise(client, run, "within", "20")
    assert ("Nothing to apply: the policy standard cannot cap at 200,704 px: max_pixels must not be below "
            "min_pixels") in page
    assert 'id="advice-apply"' not in page


def test_a_policy_changed_since_the_page_was_shown_is_not_overwritten(client, world, run):
    client.force_login(world.operator)
    page = _advise(client, run)
    ResolutionPolicy.objects.filter(pk=world.vision.resolution_policy_id).update(output_quality=70)
    response = _apply(client, run, page, follow=True)
    assert ("Not applied: the policy standard changed since this advice was shown: read the advice again before "
            "applying it.") in response.content.decode()
    assert _policy(world).max_pixels == 1_003_520 and not AuditEntry.objects.filter(object_type="resolution policy").exists()
    assert 'id="advice-summary"' in response.content.decode()  # the advice again, on the policy as it is now


def test_a_gated_tier_measures_the_advised_cap_first_on_the_check_page(client, world, run):
    eval_set = EvalSet.objects.create(name="receipts", source="imported", file_name="receipts.jsonl")
    QualityGate.objects.create(tier=world.vision, eval_set=eval_set, tolerance_points=2)
    client.force_login(world.operator)
    page = _advise(client, run)
    assert "vlm-lite is gated: applying measures the change on the gate set first" in page
    response = _apply(client, run, page)
    check = GateCheck.objects.get()
    assert response.status_code == 302 and response.url == f"/benchmarks/gates/checks/{check.pk}/"
    assert check.proposed["max_pixels"] == 401_408 and check.current["max_pixels"] == 1_003_520
    assert _policy(world).max_pixels == 1_003_520 and not AuditEntry.objects.filter(object_type="resolution policy").exists()
    check_page = client.get(response.url).content.decode()
    assert f"from the advisor: run {run.pk}, target within 3 points of the best cap, cap 401,408 px" in check_page


def test_it_says_which_other_tiers_share_the_policy(client, world, run):
    VisionTierFactory(name="vlm-pro", resolution_policy=world.vision.resolution_policy)
    client.force_login(world.operator)
    page = _advise(client, run)
    assert "The policy standard is also used by vlm-pro: a change applies to it too." in page


def test_a_run_that_did_not_succeed_gets_no_advisor(client, world):
    run = sweep(make_profile(world.vision, kind="resolution"), state="cancelled")
    client.force_login(world.operator)
    page = _advise(client, run)
    assert 'id="advisor"' not in page
    client.post(f"/benchmarks/runs/{run.pk}/advice/apply/", {"target_kind": "within", "target_points": "3",
                                                             "stamp": "x"})
    assert _policy(world).max_pixels == 1_003_520


@pytest.mark.parametrize("who", ["finance", "alice_admin", None])
def test_only_operators_get_advice_or_apply_it(client, world, run, who):
    client.force_login(world.operator)
    page = _advise(client, run)
    client.logout()
    if who:
        client.force_login(getattr(world, who))
    assert client.get(f"/benchmarks/runs/{run.pk}/", {"target_kind": "within", "target_points": "3"}).status_code \
        == (403 if who else 302)
    assert _apply(client, run, page).status_code == (403 if who else 302)
    assert _policy(world).max_pixels == 1_003_520 and not AuditEntry.objects.filter(object_type="resolution policy").exists()
