"""The command line and environment that start an engine. One builder serves both kinds:
`vllm serve` on GPU hosts and the simulator where there is no GPU, with the same flags."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LaunchSpec:
    engine_kind: str  # "vllm" or "simulator"
    model_id: str
    served_model_name: str
    family: str
    host: str
    port: int
    gpu_indices: tuple[int, ...] = ()
    settings: dict = field(default_factory=dict)
    images_per_prompt: int | None = None  # None: a text-only tier
    processor_kwargs: dict = field(default_factory=dict)  # e.g. Qwen's min_pixels/max_pixels
    max_input_pixels: int | None = None
    allowed_media_domains: tuple[str, ...] = ()
    api_key: str | None = None


# engine setting -> vLLM flag, for plain valued settings
_VALUED = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "mm_processor_cache_gb": "--mm-processor-cache-gb",
    "kv_cache_dtype": "--kv-cache-dtype",
    "scheduling_policy": "--scheduling-policy",
    "dtype": "--dtype",
}
# simulator-only cost parameters, passed as --sim-* flags
_SIMULATOR = ("prefill_us_per_token", "decode_ms_per_token", "encode_us_per_image_token", "step_overhead_ms",
              "kv_cache_tokens")


def build_command(spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
    settings = spec.settings or {}
    if spec.engine_kind == "vllm":
        argv = ["vllm", "serve", spec.model_id]
    elif spec.engine_kind == "simulator":
        argv = [sys.executable, "-m", "workers.engines.simulator", spec.model_id, "--family", spec.family]
    else:
        raise ValueError(f"engine kind {spec.engine_kind!r} cannot be launched")
    argv += ["--served-model-name", spec.served_model_name, "--host", spec.host, "--port", str(spec.port)]
    if spec.engine_kind == "vllm" and settings.get("gpu_memory_utilization") is None:
        # Always explicit: vLLM's own default moved from 0.9 to 0.92 in 0.20.
        settings = {**settings, "gpu_memory_utilization": 0.9}
    for key, flag in _VALUED.items():
        if settings.get(key) is not None:
            argv += [flag, str(settings[key])]
    if settings.get("enable_prefix_caching", True):
        argv.append("--enable-prefix-caching")
    if spec.images_per_prompt is not None:
        argv += ["--limit-mm-per-prompt", json.dumps({"image": spec.images_per_prompt})]
        if spec.processor_kwargs:  # only options the family's processor takes
            argv += ["--mm-processor-kwargs", json.dumps(spec.processor_kwargs)]
        # The gateway fetches image URLs itself and sends data URLs, so the engine need fetch
        # nothing. vLLM matches exact host names only (no wildcards) and has no "none"
        # value: a reserved .invalid name switches its fetching off.
        exact = [d for d in spec.allowed_media_domains if "*" not in d]
        argv += ["--allowed-media-domains", *(exact or ["no-engine-fetching.invalid"])]
    argv.append("--enable-prompt-tokens-details")
    if spec.engine_kind == "simulator":
        for key in _SIMULATOR:
            if settings.get(key) is not None:
                argv += ["--sim-" + key.replace("_", "-"), str(settings[key])]
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices),
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
    }
    if spec.max_input_pixels:
        env["VLLM_MAX_IMAGE_PIXELS"] = str(spec.max_input_pixels)
    if spec.api_key:
        # vLLM reads VLLM_API_KEY like --api-key; in the environment it stays out of `ps`
        # and out of the command line stored on the instance row.
        env["VLLM_API_KEY"] = spec.api_key
    return argv, env
