"""The KV planner's answer for an engine beside the KV cache the engine says it allocated.

The capacity page plans from a model's shape and a GPU's memory; here the same arithmetic
(imaging/kv.py) is held against what a running engine reports in its metrics (vLLM's
cache_config_info: blocks times tokens a block), so an operator sees how far the plan is
from reality. The model's shape comes from its config.json where the control plane can read
the model's files (a local path or the Hugging Face cache, as for its tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from controlplane.catalog.models import ModelTier
from controlplane.catalog.tokenizers import model_directory
from controlplane.imaging import kv


@dataclass(frozen=True)
class KvCheck:
    reported: int | None  # tokens, from the engine's last scrape
    predicted: int | None  # tokens, from the planner
    basis: str  # how the planner got its answer, or why it has none

    @property
    def difference(self) -> float | None:
        """(reported - predicted) / predicted."""
        if not self.reported or not self.predicted:
            return None
        return (self.reported - self.predicted) / self.predicted

    @property
    def difference_text(self) -> str:
        difference = self.difference
        if difference is None:
            return ""
        return "exactly as planned" if difference == 0 else f"{100 * difference:+.1f}% off the plan"


def _config(model_id: str) -> tuple[dict, Path] | None:
    directory = model_directory(model_id)
    if directory is None or not (directory / "config.json").is_file():
        return None
    try:
        return json.loads((directory / "config.json").read_text()), directory
    except (OSError, ValueError):
        return None


def _weights_bytes(directory: Path) -> int:
    files = list(directory.glob("*.safetensors")) or list(directory.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def _per_token(arch: kv.ModelArch, kv_cache_dtype: str) -> str:
    return (f"{arch.layers} layers × {arch.kv_heads} KV heads × {arch.head_dim} dims × 2 (K and V) × "
            f"{kv.kv_element_bytes(arch, kv_cache_dtype)} bytes = "
            f"{kv.kv_bytes_per_token(arch, kv_cache_dtype=kv_cache_dtype):,} bytes a token")


def kv_check(instance) -> KvCheck:
    """What the planner predicts for `instance`'s KV cache, beside what the engine reported."""
    tier = instance.serving_tier()
    reported = instance.kv_capacity_tokens
    if tier.engine_kind != ModelTier.EngineKind.VLLM:
        return KvCheck(reported, None, f"no plan for a {tier.get_engine_kind_display()} engine's memory")
    found = _config(tier.model_id)
    if found is None:
        return KvCheck(reported, None, "the model's config.json is not on this host")
    config, directory = found
    settings = tier.settings
    kv_dtype = settings.kv_cache_dtype or "auto"
    try:
        arch = kv.arch_from_config(config, tier.model_id, dtype=settings.dtype)
        if settings.runs_on_cpu:
            space = settings.cpu_kvcache_space_gb or kv.CPU_KV_SPACE_GIB
            predicted = kv.cpu_kv_token_capacity(arch, space_gib=space, kv_cache_dtype=kv_dtype)
            return KvCheck(reported, predicted,
                           f"{space} GiB of host memory (VLLM_CPU_KVCACHE_SPACE) in whole blocks of "
                           f"{kv.CPU_BLOCK_TOKENS} tokens; {_per_token(arch, kv_dtype)}")
    except kv.ConfigError as exc:
        return KvCheck(reported, None, f"the model's config cannot be planned from: {exc}")
    gpus = list(instance.gpus.all())
    if not gpus or not all(g.memory_mib for g in gpus):
        return KvCheck(reported, None, "the engine's GPUs and their memory are not known")
    arch = dataclasses.replace(arch, params_billion=_weights_bytes(directory) / arch.dtype_bytes / 1e9)
    utilisation = settings.gpu_memory_utilization or 0.9
    deployment = kv.Deployment(arch, kv.Gpu(gpus[0].model, min(g.memory_mib for g in gpus) / 1024),
                               tensor_parallel=settings.tensor_parallel_size, gpu_memory_utilization=utilisation,
                               kv_cache_dtype=kv_dtype)
    return KvCheck(reported, deployment.kv_token_capacity,
                   f"{utilisation:g} of {deployment.gpu.memory_gib:.0f} GiB a GPU, less the weights' "
                   f"{deployment.weights_bytes_per_gpu / kv.GIB:.1f} GiB and {deployment.overhead_gib:g} GiB for "
                   f"activations, in blocks of {kv.BLOCK_TOKENS}; {_per_token(arch, kv_dtype)}")
