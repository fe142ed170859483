"""How much KV cache an image holds, and how many requests a GPU fits.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element. With
tensor parallelism each GPU holds its share of the KV heads (at least one: vLLM replicates
heads when there are fewer heads than GPUs). vLLM allocates KV in blocks of 16 tokens, so
a request occupies whole blocks. The memory left for KV on each GPU is its memory times
`gpu_memory_utilization`, less its share of the weights and an allowance for activations,
CUDA graphs and the vision encoder's working memory during prefill.
Pure Python: no Django, no Celery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from controlplane.imaging.tokens import count_image_tokens

GIB = 1024 ** 3
BLOCK_TOKENS = 16  # vLLM's block on a GPU
CPU_BLOCK_TOKENS = 128  # vLLM's block on its CPU build (vllm/platforms/cpu.py)
CPU_KV_SPACE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE when unset
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}


@dataclass(frozen=True)
class ModelArch:
    model_id: str
    family: str
    layers: int
    kv_heads: int
    head_dim: int
    params_billion: float  # language model and vision tower
    dtype_bytes: int = 2  # weights (and a KV cache of type "auto") in bf16
    processor_options: dict = field(default_factory=dict)


class ConfigError(ValueError):
    pass


def arch_from_config(config: dict, model_id: str = "", *, dtype: str | None = None) -> ModelArch:
    """A model's KV shape from its config.json: the language model's layers, KV heads and head
    dimension (a multimodal config keeps them in text_config), and its weights' type unless
    the engine is told another (`dtype`, as vLLM's --dtype). The parameter count is not in a
    config; it is left at 0 (the weights' size is read from their files where it matters)."""
    text = config.get("text_config") or config
    try:
        layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ConfigError("the model's config names no layers, attention heads and hidden size") from None
    if dtype in (None, "", "auto"):
        dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
                    or config.get("dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown weights type {dtype!r}")
    return ModelArch(model_id, str(config.get("model_type", "")), layers, kv_heads, head_dim, 0.0,
                     dtype_bytes=DTYPE_BYTES[dtype])


# From each checkpoint's config.json (num_hidden_layers, num_key_value_heads,
# hidden_size / num_attention_heads) and its model card's parameter count.
PRESETS = {
    "qwen2.5-vl-3b": ModelArch("Qwen/Qwen2.5-VL-3B-Instruct", "qwen2_5_vl", 36, 2, 128, 3.75),
    "qwen2.5-vl-7b": ModelArch("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl", 28, 4, 128, 8.29),
    "qwen2.5-vl-72b": ModelArch("Qwen/Qwen2.5-VL-72B-Instruct", "qwen2_5_vl", 80, 8, 128, 73.4),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float


GPUS = {g.name: g for g in (
    Gpu("L4", 24), Gpu("A10G", 24), Gpu("RTX 4090", 24), Gpu("L40S", 48), Gpu("A100 40GB", 40),
    Gpu("A100 80GB", 80), Gpu("H100 80GB", 80), Gpu("H200", 141), Gpu("B200", 180),
)}


def preset_for(model_id: str) -> ModelArch | None:
    """The preset whose checkpoint `model_id` names, if any (case-insensitive)."""
    for arch in PRESETS.values():
        if arch.model_id.lower() == model_id.lower():
            return arch
    return None


def kv_element_bytes(arch: ModelArch, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one K or V value: the model's own type unless the cache is given another."""
    return arch.dtype_bytes if kv_cache_dtype == "auto" else DTYPE_BYTES[kv_cache_dtype]


def kv_bytes_per_token(arch: ModelArch, *, tensor_parallel: int = 1, kv_cache_dtype: str = "auto",
                       per_gpu: bool = False) -> int:
    """KV bytes one token holds, in total or (per_gpu) on each of the tensor-parallel GPUs."""
    element = kv_element_bytes(arch, kv_cache_dtype)
    if not per_gpu:
        return 2 * arch.layers * arch.kv_heads * arch.head_dim * element
    heads = max(1, arch.kv_heads // tensor_parallel)
    return 2 * arch.layers * heads * arch.head_dim * element


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_TOKENS)


def image_tokens(arch: ModelArch, width: int, height: int, **options) -> int:
    return count_image_tokens(arch.family, width, height, **{**arch.processor_options, **options})


def image_kv_bytes(arch: ModelArch, width: int, height: int, *, kv_cache_dtype: str = "auto",
                   **options) -> int:
    """KV bytes (all GPUs together) that one image holds for as long as its request runs."""
    return image_tokens(arch, width, height, **options) * kv_bytes_per_token(arch, kv_cache_dtype=kv_cache_dtype)


@dataclass(frozen=True)
class Deployment:
    arch: ModelArch
    gpu: Gpu
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    overhead_gib: float = 2.0  # activations, CUDA graphs, encoder working memory, per GPU

    @property
    def weights_bytes_per_gpu(self) -> float:
        return self.arch.params_billion * 1e9 * self.arch.dtype_bytes / self.tensor_parallel

    @property
    def kv_budget_bytes_per_gpu(self) -> float:
        usable = self.gpu.memory_gib * GIB * self.gpu_memory_utilization
        return max(0.0, usable - self.weights_bytes_per_gpu - self.overhead_gib * GIB)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return kv_bytes_per_token(self.arch, tensor_parallel=self.tensor_parallel,
                                  kv_cache_dtype=self.kv_cache_dtype, per_gpu=True)

    @property
    def kv_token_capacity(self) -> int:
        """Tokens of KV the deployment holds (whole blocks)."""
        block_bytes = BLOCK_TOKENS * self.kv_bytes_per_token_per_gpu
        return int(self.kv_budget_bytes_per_gpu // block_bytes) * BLOCK_TOKENS


def cpu_kv_token_capacity(arch: ModelArch, *, space_gib: float = CPU_KV_SPACE_GIB,
                          block_tokens: int = CPU_BLOCK_TOKENS, kv_cache_dtype: str = "auto") -> int:
    """Tokens of KV vLLM's CPU build allocates in `space_gib` of host memory (its
    VLLM_CPU_KVCACHE_SPACE): as many whole blocks as fit, each block holding every layer."""
    block_bytes = block_tokens * kv_bytes_per_token(arch, kv_cache_dtype=kv_cache_dtype)
    return int(space_gib * GIB // block_bytes) * block_tokens


@dataclass(frozen=True)
class RequestClass:
    share: float  # fraction of requests of this class
    text_tokens: int
    output_tokens: int
    images: tuple[tuple[int, int], ...] = ()  # width, height of each image

    def kv_tokens(self, arch: ModelArch, **options) -> int:
        prompt = self.text_tokens + sum(image_tokens(arch, w, h, **options) for w, h in self.images)
        return blocks(prompt + self.output_tokens) * BLOCK_TOKENS


@dataclass(frozen=True)
class Fit:
    concurrent_requests: int
    kv_tokens_per_request: float
    kv_token_capacity: int
    kv_budget_gib_per_gpu: float


def concurrency(deployment: Deployment, mix: list[RequestClass], **options) -> Fit:
    """How many requests of this traffic mix run at once before KV runs out."""
    total = sum(c.share for c in mix)
    if total <= 0:
        raise ValueError("a traffic mix needs at least one class with a positive share")
    per_request = sum(c.share * c.kv_tokens(deployment.arch, **options) for c in mix) / total
    capacity = deployment.kv_token_capacity
    return Fit(
        concurrent_requests=int(capacity // per_request) if per_request else 0,
        kv_tokens_per_request=per_request,
        kv_token_capacity=capacity,
        kv_budget_gib_per_gpu=deployment.kv_budget_bytes_per_gpu / GIB,
    )


@dataclass(frozen=True)
class Resolution:
    width: int
    height: int
    image_tokens: int
    concurrent_requests: int


def largest_resolution(deployment: Deployment, *, target_concurrency: int, aspect: tuple[int, int] = (4, 3),
                       text_tokens: int = 100, output_tokens: int = 256, images_per_request: int = 1,
                       max_side: int = 16384) -> Resolution | None:
    """The largest image (of `aspect`) at which `target_concurrency` requests still fit.

    The processor's own pixel cap is lifted so that the answer is about memory alone.
    Returns None when not even the smallest image fits.
    """
    long_side = max(aspect)
    share_w, share_h = aspect[0] / long_side, aspect[1] / long_side
    unbounded = {"max_pixels": max_side * max_side} if deployment.arch.family.startswith("qwen") else {}

    def fit(edge: float) -> tuple[int, int, int, int]:
        width, height = max(1, round(share_w * edge)), max(1, round(share_h * edge))
        tokens = image_tokens(deployment.arch, width, height, **unbounded)
        request = RequestClass(1.0, text_tokens, output_tokens, ((width, height),) * images_per_request)
        return width, height, tokens, concurrency(deployment, [request], **unbounded).concurrent_requests

    low, high = 28.0, float(max_side)  # the long edge, in pixels
    if fit(low)[3] < target_concurrency:
        return None
    if fit(high)[3] >= target_concurrency:
        return Resolution(*fit(high))
    while high - low > 1:
        middle = (low + high) / 2
        if fit(middle)[3] >= target_concurrency:
            low = middle
        else:
            high = middle
    return Resolution(*fit(low))
