"""Operators create and edit resolution policies in a product page: bounds that cannot work are
refused with a message, and a preview shows what sample photos become on each vision tier."""

from __future__ import annotations

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import ResolutionPolicy
from tests.pages import field_errors

pytestmark = pytest.mark.django_db


def _policy(**changes):
    data = {"name": "thrifty", "max_pixels": 401408, "low_detail_max_pixels": 200704, "min_pixels": 3136,
            "default_detail": "high", "max_long_edge": 4096, "max_aspect_ratio": 20, "tile_long_images": "on",
            "max_images_per_request": 4, "max_total_pixels": 16_000_000, "max_input_pixels": 50_000_000,
            "output_format": "jpeg", "output_quality": 85}
    data.update(changes)
    return data



@pytest.mark.parametrize(("typed", "message"), [
    ({"min_pixels": 10}, "at least 784 pixels (28 x 28)"),
    ({"low_detail_max_pixels": 900_000}, "must not exceed max_pixels"),
    ({"max_total_pixels": 1000}, "must allow at least one image at max_pixels"),
    ({"max_images_per_request": 500}, "from 1 to 64"),
    ({"output_quality": 0}, "from 1 to 100"),
    ({"allowed_formats": ["SVG"]}, "Select a valid choice. SVG is not one of the available choices."),
])
def test_bounds_that_cannot_work_are_refused_with_a_message(client, world, typed, message):
    client.force_login(world.operator)
    page = client.post("/policies/new/", {**_policy(**typed), "save": "1"}).content.decode()
    assert message in field_errors(page)
    assert not ResolutionPolicy.objects.filter(name="thrifty").exists()


def test_a_policy_is_previewed_on_each_vision_tier_then_saved_and_recorded(client, world):
    client.force_login(world.operator)
    page = client.post("/policies/new/", {**_policy(), "preview": "1"}).content.decode()
    preview = page.split('id="policy-preview"')[1].split("</table>")[0]
    row = preview.split("4032 × 3024")[1].split("</tr>")[0]
    assert world.vision.name in preview.split("4032 × 3024")[0].rsplit("<tr>", 1)[1]
    assert "728 × 532" in row  # at most 401,408 pixels, on Qwen2.5-VL's 28-pixel grid
    assert ">496<" in row and "0.001149 USD" in row  # at 0.30 per M tokens and 0.001 per image
    assert not ResolutionPolicy.objects.filter(name="thrifty").exists()
    assert client.post("/policies/new/", {**_policy(), "save": "1"}).status_code == 302
    policy = ResolutionPolicy.objects.get(name="thrifty")
    assert AuditEntry.objects.filter(object_type="resolution policy", object_id=str(policy.pk),
                                     actor=world.operator.username, action="created").exists()


def test_only_operators_edit_policies(client, world):
    client.force_login(world.finance)
    assert client.post("/policies/new/", {**_policy(), "save": "1"}).status_code == 403


def test_the_policy_page_shows_the_bounds_each_tiers_engine_is_given(client, world):
    from controlplane.catalog.engine_settings import applicable

    policy = world.vision.resolution_policy
    world.vision.engine_kind = "sglang"
    world.vision.engine_settings = applicable(world.vision.engine_settings, "sglang")
    world.vision.save()
    client.force_login(world.operator)
    page = client.get(f"/policies/{policy.name}/").content.decode()
    section = page.split('id="engine-bounds"')[1].split("</section>")[0]
    assert world.vision.name in section and "SGLang" in section
    expected = (f'--mm-process-config {{&quot;image&quot;: {{&quot;size&quot;: {{&quot;shortest_edge&quot;: '
                f'{policy.min_pixels}, &quot;longest_edge&quot;: {policy.max_pixels}}}}}}}')
    assert expected in section


@pytest.mark.parametrize("typed", [{"max_aspect_ratio": -1}, {"max_long_edge": 0}, {"max_pixels": 0}])
def test_a_value_refused_while_editing_leaves_the_preview_of_the_saved_policy(client, world, typed):
    client.force_login(world.operator)
    policy = world.vision.resolution_policy
    page = client.post(f"/policies/{policy.name}/", {**_policy(name=policy.name, **typed), "preview": "1"})
    assert page.status_code == 200
    assert field_errors(page.content.decode())
    preview = page.content.decode().split('id="policy-preview"')[1].split("</table>")[0]
    assert world.vision.name in preview
