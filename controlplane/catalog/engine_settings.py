"""A tier's engine settings: one typed object, validated in one place, read by the launcher,
the gateway and supervision.

Stored on the tier as a JSON object of the settings an operator set (the rest take their
defaults). Every key is declared below with its type, bounds, and the engine kinds it applies
to; anything else is refused with a message that names the key (and the one it was probably
meant to be), so a typo such as `max_output_tokns` can no longer be saved and silently ignored.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

VLLM, SGLANG, SIMULATOR, EXTERNAL = "vllm", "sglang", "simulator", "external"
LAUNCHED = (VLLM, SGLANG, SIMULATOR)
EVERY = (VLLM, SGLANG, SIMULATOR, EXTERNAL)
VLLM_LIKE = (VLLM, SIMULATOR)  # settings only vLLM has (the simulator takes vLLM's flags)


@dataclass(frozen=True)
class Setting:
    key: str
    kind: type  # int, float, bool, str or list (of host names)
    default: Any
    label: str
    help: str
    engines: tuple[str, ...] = LAUNCHED
    group: str = "engine"  # engine, gateway, cpu, simulator
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    flag: str = ""  # the vLLM flag it becomes, shown beside it
    sglang_flag: str = ""  # the SGLang flag it becomes (launch.py; checked against SGLang's parser)
    sglang_choices: tuple[str, ...] = ()  # where SGLang accepts other values than vLLM

    def flag_for(self, engine_kind: str) -> str:
        return self.sglang_flag if engine_kind == SGLANG else self.flag

    def choices_for(self, engine_kind: str) -> tuple[str, ...]:
        return self.sglang_choices if engine_kind == SGLANG and self.sglang_choices else self.choices


SETTINGS = (
    # What the engine is started with (vLLM flags; the simulator takes the same ones).
    Setting("tensor_parallel_size", int, 1, "Tensor parallel size", "GPUs one replica is split over.",
            minimum=1, maximum=64, flag="--tensor-parallel-size", sglang_flag="--tp-size"),
    Setting("gpu_memory_utilization", float, None, "GPU memory utilisation",
            "Share of each GPU's memory vLLM may take for weights and KV cache (0.9 when unset).",
            minimum=0.05, maximum=0.99, flag="--gpu-memory-utilization", sglang_flag="--mem-fraction-static"),
    Setting("max_model_len", int, 32768, "Context length", "Longest prompt plus output, in tokens.",
            engines=EVERY, minimum=256, maximum=1_048_576, flag="--max-model-len", sglang_flag="--context-length"),
    Setting("max_num_seqs", int, None, "Running requests", "Requests one replica runs at once.",
            minimum=1, maximum=4096, flag="--max-num-seqs", sglang_flag="--max-running-requests"),
    Setting("max_num_batched_tokens", int, None, "Tokens per step",
            "Tokens one scheduler step may process (chunked prefill's budget).",
            minimum=16, maximum=1_048_576, flag="--max-num-batched-tokens",
            sglang_flag="--chunked-prefill-size"),
    Setting("mm_processor_cache_gb", float, None, "Image preprocessing cache (GiB)",
            "vLLM's cache of preprocessed images; repeated images skip the processor.",
            engines=VLLM_LIKE, minimum=0, maximum=1024, flag="--mm-processor-cache-gb"),
    Setting("kv_cache_dtype", str, None, "KV cache type", "Lower precision holds more tokens.",
            choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), flag="--kv-cache-dtype",
            sglang_flag="--kv-cache-dtype", sglang_choices=("auto", "fp8_e4m3", "fp8_e5m2")),
    Setting("scheduling_policy", str, "priority", "Scheduling",
            "priority: text ahead of images and images ahead of large images (the gateway's priorities), "
            "supervision's probes ahead of all; fcfs: in order of arrival.",
            engines=LAUNCHED, choices=("fcfs", "priority"), flag="--scheduling-policy",
            sglang_flag="--enable-priority-scheduling --schedule-low-priority-values-first"),
    Setting("dtype", str, None, "Weights type", "Precision of the weights and activations.",
            choices=("auto", "half", "float16", "bfloat16", "float", "float32"), flag="--dtype", sglang_flag="--dtype"),
    Setting("enable_prefix_caching", bool, True, "Prefix caching",
            "Reuse the KV cache of repeated prompt prefixes, repeated images included.",
            flag="--enable-prefix-caching", sglang_flag="--disable-radix-cache (when off)"),
    Setting("tool_call_parser", str, None, "Tool-call parser",
            "The engine's parser for the model's tool calls (each engine names its own); without one, "
            "requests with tools are refused.",
            engines=LAUNCHED, choices=("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder",
                                       "internlm", "granite", "jamba"),
            flag="--tool-call-parser", sglang_flag="--tool-call-parser",
            sglang_choices=("hermes", "llama3", "mistral", "pythonic", "qwen25", "qwen3_coder")),
    Setting("device", str, "gpu", "Device", "cpu runs vLLM's CPU build on a node without GPUs.",
            engines=(VLLM,), choices=("gpu", "cpu")),
    # vLLM's CPU build (device: cpu): environment variables instead of flags.
    Setting("cpu_kvcache_space_gb", int, None, "KV cache (GiB of host memory)",
            "VLLM_CPU_KVCACHE_SPACE; 4 when unset.", engines=(VLLM,), group="cpu", minimum=1, maximum=4096),
    Setting("cpu_threads_bind", str, None, "Core binding",
            "VLLM_CPU_OMP_THREADS_BIND: auto, all, or core ids such as 0-15.", engines=(VLLM,), group="cpu"),
    Setting("cpu_reserved_cores", int, None, "Reserved cores", "VLLM_CPU_NUM_OF_RESERVED_CPU.",
            engines=(VLLM,), group="cpu", minimum=0, maximum=1024),
    Setting("cpu_nice", int, None, "Niceness",
            "Scheduling niceness of the engine (10 on CPU nodes, so supervision stays responsive).",
            engines=VLLM_LIKE, group="cpu", minimum=-20, maximum=19),
    # What the gateway does for the tier.
    Setting("max_output_tokens", int, 4096, "Output cap", "Most output tokens a request may ask for.",
            engines=EVERY, group="gateway", minimum=1, maximum=1_048_576),
    Setting("fetch_image_urls", bool, True, "Fetch image URLs",
            "The gateway downloads http(s) images itself (engines never fetch).", engines=EVERY, group="gateway"),
    Setting("allowed_media_domains", list, (), "Image hosts",
            "Host names image URLs may come from (*.example.com allowed); empty: any public host.",
            engines=EVERY, group="gateway"),
    Setting("require_moderation", bool, False, "Moderate prompts",
            "Send each prompt, its text and its images, to the moderation endpoint (MODERATION_URL) "
            "before the engine; a flagged prompt is refused, and so is every prompt while the endpoint "
            "cannot answer.", engines=EVERY, group="gateway"),
    Setting("image_prefill_slots", int, 2, "Image prefills per engine",
            "Image requests an engine has between dispatch and first token at once, over every gateway "
            "replica; others wait their turn (per-tenant fair) or take another engine with a slot free.",
            engines=EVERY, group="gateway", minimum=1, maximum=64),
    Setting("large_image_concurrency", int, 2, "Large images at once",
            "Requests with large images in prefill at once across the tier's standard engines, over every "
            "gateway replica (per-tenant fair); a large-image pool takes them instead when it has replicas.",
            engines=EVERY, group="gateway", minimum=1, maximum=1024),
    Setting("ttft_objective_text_ms", int, None, "Text first token, p95 objective (ms)",
            "The time to first token text requests should get at p95 (a whole answer's, unstreamed); "
            "a latency objective alert fires past it.", engines=EVERY, group="gateway", minimum=1,
            maximum=3_600_000),
    Setting("ttft_objective_image_ms", int, None, "Image first token, p95 objective (ms)",
            "The same for requests with images under the large-image threshold.", engines=EVERY,
            group="gateway", minimum=1, maximum=3_600_000),
    Setting("ttft_objective_large_ms", int, None, "Large image first token, p95 objective (ms)",
            "The same for requests with images past the large-image threshold.", engines=EVERY,
            group="gateway", minimum=1, maximum=3_600_000),
    Setting("large_pool_replicas", int, 0, "Large-image replicas",
            "Replicas kept apart for requests over the large-image threshold.", group="gateway",
            minimum=0, maximum=64),
    # The simulator's cost model.
    Setting("prefill_us_per_token", float, None, "Prefill (µs per token)", "", engines=(SIMULATOR,),
            group="simulator", minimum=0, maximum=1e6),
    Setting("decode_ms_per_token", float, None, "Decode (ms per token)", "", engines=(SIMULATOR,),
            group="simulator", minimum=0, maximum=1e4),
    Setting("encode_us_per_image_token", float, None, "Image encoding (µs per token)", "",
            engines=(SIMULATOR,), group="simulator", minimum=0, maximum=1e6),
    Setting("step_overhead_ms", float, None, "Step overhead (ms)", "", engines=(SIMULATOR,),
            group="simulator", minimum=0, maximum=1e4),
    Setting("kv_cache_tokens", int, None, "KV cache (tokens)", "", engines=(SIMULATOR,), group="simulator",
            minimum=256, maximum=100_000_000),
    Setting("engine_api", str, None, "Speaks",
            "Whose API the simulator imitates: vLLM's (when unset) or SGLang's endpoints and metric names.",
            engines=(SIMULATOR,), group="simulator", choices=("vllm", "sglang")),
)
BY_KEY = {setting.key: setting for setting in SETTINGS}


class EngineSettingsError(ValueError):
    """Settings that cannot be used; `messages` maps each key at fault to what is wrong."""

    def __init__(self, messages: dict[str, str]):
        super().__init__("; ".join(f"{key}: {message}" for key, message in messages.items()))
        self.messages = messages


@dataclass(frozen=True)
class EngineSettings:
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    max_model_len: int = 32768
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    mm_processor_cache_gb: float | None = None
    kv_cache_dtype: str | None = None
    scheduling_policy: str | None = None
    dtype: str | None = None
    enable_prefix_caching: bool = True
    tool_call_parser: str | None = None
    device: str = "gpu"
    cpu_kvcache_space_gb: int | None = None
    cpu_threads_bind: str | None = None
    cpu_reserved_cores: int | None = None
    cpu_nice: int | None = None
    max_output_tokens: int = 4096
    fetch_image_urls: bool = True
    allowed_media_domains: tuple[str, ...] = ()
    require_moderation: bool = False
    image_prefill_slots: int = 2
    large_image_concurrency: int = 2
    large_pool_replicas: int = 0
    ttft_objective_text_ms: int | None = None
    ttft_objective_image_ms: int | None = None
    ttft_objective_large_ms: int | None = None
    prefill_us_per_token: float | None = None
    decode_ms_per_token: float | None = None
    encode_us_per_image_token: float | None = None
    step_overhead_ms: float | None = None
    kv_cache_tokens: int | None = None
    engine_api: str | None = None
    given: tuple[str, ...] = field(default=(), compare=False, repr=False)  # the keys an operator set

    @classmethod
    def parse(cls, raw: dict | None, engine_kind: str) -> EngineSettings:
        """The settings `raw` names for an engine of `engine_kind`, or EngineSettingsError
        saying what is wrong with each key at fault."""
        raw = raw or {}
        if not isinstance(raw, dict):
            raise EngineSettingsError({"settings": "must be an object of setting: value"})
        values, errors = {}, {}
        for key, value in raw.items():
            setting = BY_KEY.get(key)
            if setting is None:
                close = difflib.get_close_matches(key, BY_KEY, n=1, cutoff=0.6)
                errors[key] = "unknown setting" + (f" (did you mean {close[0]}?)" if close else "")
                continue
            if engine_kind not in setting.engines:
                errors[key] = f"does not apply to {engine_kind} engines (only {', '.join(setting.engines)})"
                continue
            if value is None:
                continue
            try:
                values[key] = _typed(setting, value, engine_kind)
            except ValueError as exc:
                errors[key] = str(exc)
        if not errors:
            errors.update(_together(values, engine_kind))
        if errors:
            raise EngineSettingsError(errors)
        defaults = {"scheduling_policy": "priority"} if engine_kind in LAUNCHED else {}
        return cls(**{**defaults, **values}, given=tuple(values))

    def stored(self) -> dict:
        """The settings an operator set, typed, as the tier stores them (the rest keep
        following their defaults)."""
        return {key: list(value) if isinstance(value := getattr(self, key), tuple) else value
                for key in self.given}

    def ttft_objectives(self) -> dict[str, int]:
        """The p95 time to first token each request class should get, where one is set (ms)."""
        return {kind: value for kind in ("text", "image", "large")
                if (value := getattr(self, f"ttft_objective_{kind}_ms")) is not None}

    @property
    def runs_on_cpu(self) -> bool:
        return self.device == "cpu"


def applicable(raw: dict | None, engine_kind: str) -> dict:
    """Of the settings `raw` names, those an engine of `engine_kind` takes (what a tier moved
    to another engine kind keeps)."""
    return {key: value for key, value in (raw or {}).items()
            if key in BY_KEY and engine_kind in BY_KEY[key].engines}


def _typed(setting: Setting, value, engine_kind: str):
    kind = setting.kind
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
        return value
    if kind is list:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v.strip() for v in value):
            raise ValueError("must be a list of host names")
        return tuple(v.strip().lower() for v in value)
    if kind is str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("must be text")
        value = value.strip()
        choices = setting.choices_for(engine_kind)
        if choices and value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError("must be a whole number")
        value = int(value)
    else:
        value = float(value)
    if setting.minimum is not None and value < setting.minimum:
        raise ValueError(f"must be at least {setting.minimum:g}")
    if setting.maximum is not None and value > setting.maximum:
        raise ValueError(f"must be at most {setting.maximum:g}")
    return value


def _together(values: dict, engine_kind: str) -> dict[str, str]:
    """Rules between settings."""
    errors = {}
    context = values.get("max_model_len", BY_KEY["max_model_len"].default)
    if values.get("max_output_tokens", BY_KEY["max_output_tokens"].default) >= context:
        errors["max_output_tokens"] = f"must be below the context length ({context:,} tokens)"
    if values.get("device") != "cpu":
        for key in ("cpu_kvcache_space_gb", "cpu_threads_bind", "cpu_reserved_cores"):
            if key in values:
                errors[key] = "applies to vLLM's CPU build only (device: cpu)"
    elif "gpu_memory_utilization" in values:
        errors["gpu_memory_utilization"] = "does not apply to vLLM's CPU build (device: cpu)"
    batched = values.get("max_num_batched_tokens")
    if batched is not None and batched < values.get("max_num_seqs", 1):
        errors["max_num_batched_tokens"] = "must be at least the number of running requests"
    return errors
