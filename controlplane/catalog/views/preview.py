"""What a tier will do, shown on its pages before it is saved: the command its engines start
with, what sample images cost on it, and whether it fits the GPUs it would run on."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from decimal import Decimal

from django.conf import settings
from django.utils import timezone

from controlplane.catalog.engine_settings import EngineSettingsError
from controlplane.catalog.models import ModelTier
from controlplane.catalog.services import tier_image_tokens
from controlplane.fleet.models import Gpu
from controlplane.imaging import kv
from controlplane.imaging.errors import ImageError
from controlplane.imaging.policy import sent_sizes
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.metering.rating import images_price
from workers.engines.launch import build_command
from workers.supervision.engine import tier_launch_spec

# Photos as tenants send them: a small web image, HD, full HD, a 12 MP phone photo.
SAMPLE_SIZES = ((640, 480), (1280, 720), (1920, 1080), (4032, 3024))
# The prompt around the images in the capacity estimate.
TEXT_TOKENS, OUTPUT_TOKENS = 200, 256


@dataclass(frozen=True)
class ImageSample:
    width: int
    height: int
    sent: list[tuple[int, int]]  # what the policy makes of it (tiles for a long one)
    tokens: int
    cost: Decimal | None  # None: the plan has no rate in effect


@dataclass(frozen=True)
class GpuFit:
    gpu: str
    fits: bool
    verdict: str
    concurrent_requests: int = 0
    kv_tokens: int = 0


@dataclass
class TierPlan:
    command: str = ""
    environment: dict[str, str] = field(default_factory=dict)
    samples: list[ImageSample] = field(default_factory=list)
    currency: str = ""
    fits: list[GpuFit] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def tier_plan(tier: ModelTier) -> TierPlan:
    """What `tier` will do, as it stands (saved or not)."""

    plan = TierPlan(currency=tier.price_plan.currency if tier.price_plan_id else "")
    try:
        engine = tier.settings
    except EngineSettingsError as exc:
        plan.problems.append(f"engine settings: {exc}")
        return plan
    if tier.engine_kind != ModelTier.EngineKind.EXTERNAL:
        gpus = 0 if engine.runs_on_cpu or tier.engine_kind == ModelTier.EngineKind.SIMULATOR else max(
            tier.gpus_per_replica, engine.tensor_parallel_size)
        try:
            argv, env = build_command(tier_launch_spec(tier, port=settings.ENGINE_PORT_BASE,
                                                       gpu_indices=tuple(range(gpus))))
            plan.command = shlex.join(argv)
            plan.environment = env
        except ValueError as exc:
            plan.problems.append(f"cannot launch: {exc}")
    rates = rates_now(tier)
    if tier.kind == ModelTier.Kind.VISION and tier.resolution_policy is not None:
        plan.samples = samples(tier, rates)
    if tier.price_plan_id and rates is None:
        plan.problems.append("its price plan has no rate in effect: the tier cannot be enabled until it has one")
    plan.fits = _fits(tier)
    return plan


# The flag that gives an engine's image processor its pixel bounds, per engine kind.
BOUNDS_FLAGS = ("--mm-processor-kwargs", "--mm-process-config")


def engine_image_bounds(tier: ModelTier) -> str:
    """How the tier's engine is told the policy's pixel bounds, as its command line says it
    (the same bounds the gateway counts image tokens with), or why it is not."""

    if tier.engine_kind == ModelTier.EngineKind.EXTERNAL:
        return "not launched here: the engine keeps its own bounds (SGLang's Qwen-VL default takes up to 12.8 MP)"
    try:
        argv, _ = build_command(tier_launch_spec(tier, port=settings.ENGINE_PORT_BASE))
    except (ValueError, EngineSettingsError) as exc:
        return f"cannot launch: {exc}"
    for flag in BOUNDS_FLAGS:
        if flag in argv:
            return f"{flag} {argv[argv.index(flag) + 1]}"
    return "none: this model's processor takes no pixel bounds; the gateway's downscale bounds it"


def rates_now(tier: ModelTier, book: RateBook | None = None):
    """The rates of the tier's plan in effect now, or None. A page of many tiers gives the
    `book` it loaded their plans into."""
    try:
        return (book or RateBook()).rates_at(tier.price_plan_id, timezone.now()) if tier.price_plan_id else None
    except NoRate:
        return None


def samples(tier: ModelTier, rates) -> list[ImageSample]:
    """What the sample photos become on `tier`, priced at `rates` (None: no rate in effect)."""
    policy = tier.image_policy()
    samples = []
    for width, height in SAMPLE_SIZES:
        try:
            sent = sent_sizes(width, height, policy)
        except ImageError:
            continue  # past the policy's input limit: refused, so nothing to show
        each = [tier_image_tokens(tier, w, h) for w, h in sent]
        tokens, cost = sum(each), images_price(each, rates) if rates else None
        samples.append(ImageSample(width, height, sent, tokens, cost))
    return samples


def _largest_request_tokens(tier: ModelTier) -> tuple[int, str]:
    """The most prompt tokens the policy lets one request's images reach, and how."""
    policy = tier.resolution_policy
    if tier.kind != ModelTier.Kind.VISION or policy is None:
        return 0, ""
    # An upright 4:3 picture at the policy's pixel cap, as many as a request may carry.
    width = int(math.sqrt(policy.max_pixels * 4 / 3))
    height = int(policy.max_pixels / width)
    per_image = tier_image_tokens(tier, width, height)
    count = policy.max_images_per_request
    return per_image * count, f"{count} image{'s' * (count != 1)} at the policy's cap of {policy.max_pixels:,} pixels"


def _fits(tier: ModelTier) -> list[GpuFit]:
    """For each GPU type of the fleet (or an H100 when the fleet has none yet): does one
    replica hold its weights, a request of the full context length, and how many requests
    with images at the policy's cap run at once."""

    engine = tier.settings
    if tier.engine_kind != ModelTier.EngineKind.VLLM or engine.runs_on_cpu:
        return []
    arch = kv.preset_for(tier.model_id)
    if arch is None:
        return [GpuFit("", False, f"no size known for {tier.model_id}: the capacity planner knows "
                                   + ", ".join(a.model_id for a in kv.PRESETS.values()))]
    names = {name for model in Gpu.objects.values_list("model", flat=True).distinct()
             for name in kv.GPUS if model and (name.lower() in model.lower() or model.lower() in name.lower())}
    image_tokens, how = _largest_request_tokens(tier)
    found = []
    for name in sorted(names) or ["H100 80GB"]:
        deployment = kv.Deployment(arch, kv.GPUS[name], tensor_parallel=engine.tensor_parallel_size,
                                   gpu_memory_utilization=engine.gpu_memory_utilization or 0.9,
                                   kv_cache_dtype=engine.kv_cache_dtype or "auto")
        capacity = deployment.kv_token_capacity
        label = f"{engine.tensor_parallel_size} x {name}"
        if capacity <= 0:
            found.append(GpuFit(label, False, f"the weights ({deployment.weights_bytes_per_gpu / kv.GIB:.1f} GiB "
                                              "per GPU) leave no memory for the KV cache"))
            continue
        if capacity < engine.max_model_len:
            found.append(GpuFit(label, False, f"the KV cache holds {capacity:,} tokens, fewer than the context "
                                              f"length of {engine.max_model_len:,}: vLLM would refuse to start",
                                kv_tokens=capacity))
            continue
        request = min(engine.max_model_len, TEXT_TOKENS + image_tokens + OUTPUT_TOKENS)
        concurrent = capacity // (kv.blocks(request) * kv.BLOCK_TOKENS)
        if engine.max_num_seqs:
            concurrent = min(concurrent, engine.max_num_seqs)
        verdict = f"{concurrent:,} requests at once" + (f" with {how}" if how else "")
        if image_tokens + TEXT_TOKENS > engine.max_model_len:
            verdict += (f"; but {how} come to {image_tokens:,} tokens, past the context length of "
                        f"{engine.max_model_len:,}: such requests are refused")
        found.append(GpuFit(label, True, verdict, concurrent, capacity))
    return found
