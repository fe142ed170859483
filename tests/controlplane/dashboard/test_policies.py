from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from tests.factories import ResolutionPolicyFactory, VisionTierFactory
from tests.images import image_bytes

pytestmark = pytest.mark.django_db


def _upload(client, data, name="photo.jpg", detail="auto"):
    return client.post("/policies/", {"image": SimpleUploadedFile(name, data), "detail": detail})


def test_a_dropped_image_shows_each_tiers_size_tokens_and_cost(client, world):
    detailed = ResolutionPolicyFactory(name="detailed", max_pixels=3_211_264)
    VisionTierFactory(name="vlm-flagship", resolution_policy=detailed)
    client.force_login(world.operator)
    page = _upload(client, image_bytes(1920, 1080)).content.decode()
    lite = page.split('data-tier="vlm-lite"')[1].split("</tr>")[0]
    flagship = page.split('data-tier="vlm-flagship"')[1].split("</tr>")[0]
    assert "1316×728" in lite and ">1224<" in lite  # 1,003,520-pixel cap, on Qwen's 28-pixel grid
    assert "1920×1080" in flagship  # under the flagship's cap: sent as it is
    assert "USD" in lite
    commercial = page.split('id="commercial"')[1]
    assert "OpenAI" in commercial and "Anthropic" in commercial and "Gemini" in commercial


def test_low_detail_and_long_images_show_in_the_preview(client, world):
    client.force_login(world.operator)
    low = _upload(client, image_bytes(1920, 1080), detail="low").content.decode()
    assert ">1224<" not in low.split('data-tier="vlm-lite"')[1].split("</tr>")[0]
    policy = world.vision.resolution_policy
    policy.max_aspect_ratio = 4
    policy.save()
    receipt = _upload(client, image_bytes(300, 3000, "PNG"), name="receipt.png").content.decode()
    assert "(3 tiles)" in receipt


def test_a_bad_upload_says_what_is_wrong(client, world):
    client.force_login(world.operator)
    page = _upload(client, b"<svg xmlns='http://www.w3.org/2000/svg'/>", name="x.svg").content.decode()
    assert 'id="preview-error"' in page and "SVG" in page


def test_the_page_draws_each_tiers_resolution_curve_and_is_closed_to_tenants(client, world):
    client.force_login(world.finance)
    page = client.get("/policies/").content.decode()
    assert 'id="resolution-curves"' in page and "vlm-lite" in page
    client.force_login(world.alice_admin)
    assert client.get("/policies/").status_code == 403


def test_the_capacity_planner_answers_for_a_model_and_gpu(client, world):
    client.force_login(world.operator)
    page = client.get("/capacity/", {
        "model": "qwen2.5-vl-7b", "gpu": "H100 80GB", "tensor_parallel": 1, "gpu_memory_utilization": 0.9,
        "kv_cache_dtype": "auto", "image_share": 0.5, "image_width": 1920, "image_height": 1080,
        "max_pixels": 1_003_520, "text_tokens": 200, "output_tokens": 256, "target_concurrency": 64,
    }).content.decode()
    assert '<span id="image-tokens">1224</span>' in page
    assert "56.0\xa0KB" in page  # 57,344 bytes per token (filesizeformat uses a no-break space)
    concurrency = int(page.split('id="concurrency">')[1].split("<")[0])
    assert concurrency > 64
    assert "×" in page.split('id="largest">')[1].split("</td>")[0]
    client.force_login(world.finance)
    assert client.get("/capacity/").status_code == 403
