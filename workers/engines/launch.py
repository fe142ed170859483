"""The command line and environment that start an engine: `vllm serve` (on GPUs, or vLLM's
CPU build on nodes without them), the simulator (which takes vLLM's flags), or SGLang's
server (its own flags, from the same settings)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from controlplane.catalog.engine_settings import SETTINGS, EngineSettings
from workers.engines import sglang_server


@dataclass(frozen=True)
class LaunchSpec:
    engine_kind: str  # "vllm", "sglang" or "simulator"
    model_id: str
    served_model_name: str
    family: str
    host: str
    port: int
    gpu_indices: tuple[int, ...] = ()
    settings: EngineSettings = field(default_factory=EngineSettings)
    images_per_prompt: int | None = None  # None: a text-only tier
    processor_kwargs: dict = field(default_factory=dict)  # e.g. Qwen's min_pixels/max_pixels
    max_input_pixels: int | None = None
    allowed_media_domains: tuple[str, ...] = ()
    api_key: str | None = None
    # The Python of the environment vLLM is installed in (the node agent's VLLM_PYTHON).
    vllm_python: str = sys.executable
    # The Python of the environment SGLang is installed in (the node agent's SGLANG_PYTHON).
    sglang_python: str = sys.executable
    # The node's transformers release, which decides the form of the processor's pixel bounds.
    transformers_version: str = ""

    @property
    def nice(self) -> int:
        """Scheduling niceness of the engine's processes. vLLM's CPU build keeps its cores
        busy while it generates (its worker threads and scheduler spin), so on a CPU node it
        runs below the node agent and gateway, which must stay responsive to supervise and
        route it; GPU engines compute on the GPU and run at normal priority."""
        if self.settings.cpu_nice is not None:
            return self.settings.cpu_nice
        return CPU_NICE_DEFAULT if self.runs_on_cpu else 0

    @property
    def runs_on_cpu(self) -> bool:
        """vLLM's CPU build (engine setting `device: cpu`), as ModelTier.runs_on_cpu says."""
        return self.engine_kind == "vllm" and self.settings.runs_on_cpu


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
# Passed even when the operator left it unset (vLLM's own default changed between releases).
_ALWAYS = ("gpu_memory_utilization", "scheduling_policy")
# CPU engines: engine setting -> vLLM environment variable (vllm/envs.py). The KV cache is
# sized in GiB of host memory instead of as a fraction of GPU memory.
_CPU_ENVIRONMENT = {
    "cpu_kvcache_space_gb": "VLLM_CPU_KVCACHE_SPACE",
    "cpu_threads_bind": "VLLM_CPU_OMP_THREADS_BIND",  # "auto", "all", or core ids like "0-15"
    "cpu_reserved_cores": "VLLM_CPU_NUM_OF_RESERVED_CPU",
}
CPU_KVCACHE_DEFAULT_GB = 4
CPU_NICE_DEFAULT = 10
# simulator-only cost parameters, passed as --sim-* flags
_SIMULATOR = ("prefill_us_per_token", "decode_ms_per_token", "encode_us_per_image_token", "step_overhead_ms",
              "kv_cache_tokens")


def _text(value) -> str:
    """A setting as a flag's value: 4, not 4.0."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _major(version: str) -> int:
    head = version.strip().split(".")[0]
    return int(head) if head.isdigit() else 0


def processor_flags(processor_kwargs: dict, transformers_version: str) -> dict:
    """Qwen-VL pixel bounds in the form the node's transformers takes. transformers 5
    deprecates min_pixels/max_pixels (removal announced) for size {shortest_edge,
    longest_edge}, which bounds the area identically; releases before 5 take the pair."""
    if _major(transformers_version) < 5 or not {"min_pixels", "max_pixels"} <= processor_kwargs.keys():
        return processor_kwargs
    rest = {k: v for k, v in processor_kwargs.items() if k not in ("min_pixels", "max_pixels")}
    return {**rest, "size": {"shortest_edge": processor_kwargs["min_pixels"],
                             "longest_edge": processor_kwargs["max_pixels"]}}


def _media_domains(spec: LaunchSpec) -> list[str]:
    """The gateway fetches image URLs itself and sends data URLs, so the engine need fetch
    nothing. vLLM and SGLang match exact host names only (no wildcards) and have no "none"
    value: a reserved .invalid name switches their fetching off."""
    exact = [d for d in spec.allowed_media_domains if "*" not in d]
    return ["--allowed-media-domains", *(exact or ["no-engine-fetching.invalid"])]


def build_command(spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
    if spec.engine_kind == "sglang":
        return sglang_command(spec)
    settings = spec.settings
    cpu = spec.runs_on_cpu
    if spec.engine_kind == "vllm":
        # The module behind the `vllm` command, run by the engine environment's Python.
        argv = [spec.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", spec.model_id]
    elif spec.engine_kind == "simulator":
        argv = [sys.executable, "-m", "workers.engines.simulator", spec.model_id, "--family", spec.family]
    else:
        raise ValueError(f"engine kind {spec.engine_kind!r} cannot be launched")
    argv += ["--served-model-name", spec.served_model_name, "--host", spec.host, "--port", str(spec.port)]
    if cpu:
        settings = replace(settings, gpu_memory_utilization=None)
    elif spec.engine_kind == "vllm" and settings.gpu_memory_utilization is None:
        # Always explicit: vLLM's own default moved from 0.9 to 0.92 in 0.20.
        settings = replace(settings, gpu_memory_utilization=0.9)
    for key, flag in _VALUED.items():
        if getattr(settings, key) is not None and (key in settings.given or key in _ALWAYS):
            argv += [flag, _text(getattr(settings, key))]
    if settings.enable_prefix_caching:
        argv.append("--enable-prefix-caching")
    if spec.images_per_prompt is not None:
        # "video": 0 as well: otherwise vLLM sizes its encoder budget for a maximal video,
        # which the gateway never sends (8,960 tokens against 2,048 for four images).
        argv += ["--limit-mm-per-prompt", json.dumps({"image": spec.images_per_prompt, "video": 0})]
        if spec.processor_kwargs:  # only options the family's processor takes
            kwargs = processor_flags(spec.processor_kwargs, spec.transformers_version) \
                if spec.engine_kind == "vllm" else spec.processor_kwargs
            argv += ["--mm-processor-kwargs", json.dumps(kwargs)]
        argv += _media_domains(spec)
    argv.append("--enable-prompt-tokens-details")
    if settings.tool_call_parser:
        # Without both, vLLM answers every request that carries tools with a 400.
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_call_parser]
    if spec.engine_kind == "simulator":
        for key in _SIMULATOR:
            if getattr(settings, key) is not None:
                argv += ["--sim-" + key.replace("_", "-"), _text(getattr(settings, key))]
        if settings.engine_api:
            argv += ["--api", settings.engine_api]
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices),
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
    }
    if cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        defaults = {"cpu_kvcache_space_gb": CPU_KVCACHE_DEFAULT_GB, "cpu_threads_bind": "auto"}
        for key, variable in _CPU_ENVIRONMENT.items():
            value = getattr(settings, key)
            value = defaults.get(key) if value is None else value
            if value is not None:  # whole numbers where vLLM reads them with int(): checked when set
                env[variable] = str(value)
    if spec.max_input_pixels:
        env["VLLM_MAX_IMAGE_PIXELS"] = str(spec.max_input_pixels)
    if spec.api_key:
        # vLLM reads VLLM_API_KEY like --api-key; in the environment it stays out of `ps`
        # and out of the command line stored on the instance row.
        env["VLLM_API_KEY"] = spec.api_key
    return argv, env


# SGLang's server, started by a small program of ours (sglang_server.py) that takes the API
# key from the environment: SGLang reads it from --api-key only.
SGLANG_SERVER = Path(sglang_server.__file__)
# engine setting -> SGLang flag, as each setting declares it (engine_settings.py), for the
# settings with a value (on/off ones are handled below). tool_call_parser among them: SGLang
# turns tool choice on with the parser alone.
_SGLANG_VALUED = {setting.key: setting.sglang_flag for setting in SETTINGS
                  if setting.sglang_flag and setting.kind is not bool and setting.key != "scheduling_policy"}
# Passed even when unset: the context length is what the gateway admits against, and SGLang
# would otherwise take the model's own (128K for Qwen2.5-VL).
_SGLANG_ALWAYS = ("max_model_len",)


def sglang_command(spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
    """SGLang's launch_server with the tier's settings and resolution policy.

    The image bounds go to the model's processor through --mm-process-config, in the form
    transformers 5 takes ({"size": {"shortest_edge", "longest_edge"}}: every SGLang release
    checked runs on transformers 5). Without them SGLang's Qwen-VL processor takes images up
    to 16384 patches of 28 x 28 (12.8 MP) where the gateway counted at most the policy's cap.
    """
    settings = spec.settings
    argv = [spec.sglang_python, str(SGLANG_SERVER), "--model-path", spec.model_id,
            "--served-model-name", spec.served_model_name, "--host", spec.host, "--port", str(spec.port)]
    for key, flag in _SGLANG_VALUED.items():
        value = getattr(settings, key)
        if value is not None and (key in settings.given or key in _SGLANG_ALWAYS):
            argv += [flag, _text(value)]
    if not settings.enable_prefix_caching:
        argv.append("--disable-radix-cache")
    if settings.scheduling_policy == "priority":
        # vLLM's order: the lower value first (SGLang's own default is the higher first).
        argv += ["--enable-priority-scheduling", "--schedule-low-priority-values-first",
                 "--default-priority-value", "0"]
    # Prometheus metrics for supervision and the fleet page; cached prompt tokens in each
    # response's usage, as vLLM's --enable-prompt-tokens-details gives.
    argv += ["--enable-metrics", "--enable-cache-report"]
    if spec.images_per_prompt is not None:
        argv += ["--limit-mm-data-per-request", json.dumps({"image": spec.images_per_prompt, "video": 0})]
        if spec.processor_kwargs:
            argv += ["--mm-process-config", json.dumps({"image": processor_flags(spec.processor_kwargs, "5")})]
        argv += _media_domains(spec)  # SGLang, like vLLM, matches exact host names
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices),
        # /health answers from the server's state alone: supervision sends its own one-token
        # probe now and then, instead of SGLang generating on every health check.
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    }
    env[sglang_server.VARIABLES_TO_CHECK] = ",".join(sorted(name for name in env if name.startswith("SGLANG_")))
    if spec.api_key:
        env[sglang_server.KEY_VARIABLE] = spec.api_key
    return argv, env
