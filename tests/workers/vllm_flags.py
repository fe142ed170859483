"""The `vllm serve` flags the launcher may emit, as vLLM documents them, with their value forms.

Read from vLLM's published packages (0.11.x to 0.33.0): engine flags in
vllm/engine/arg_utils.py and vllm/config/{model,cache,scheduler,parallel,multimodal}.py,
front-end flags in vllm/entrypoints/openai/cli_args.py (later launchers/ and common/).
None: a switch without a value. A callable: the value(s) that follow, as a list of strings.
"""

from __future__ import annotations

import json


def _int(values):
    return len(values) == 1 and int(values[0]) >= 1


def _fraction(values):
    return len(values) == 1 and 0 < float(values[0]) <= 1


def _json_object(values):
    return len(values) == 1 and isinstance(json.loads(values[0]), dict)


def _limit_mm(values):
    limits = json.loads(values[0]) if len(values) == 1 else None
    # {"image": 4}; the {"image": {"count": ...}} form needs vLLM 0.11.1, so we use counts only
    return isinstance(limits, dict) and all(isinstance(v, int) and v >= 0 for v in limits.values())


def _hosts(values):
    return len(values) >= 1 and all("*" not in v and "/" not in v and ":" not in v for v in values)


DOCUMENTED = {
    "--served-model-name": lambda v: len(v) >= 1,
    "--host": lambda v: len(v) == 1,
    "--port": lambda v: len(v) == 1 and 0 < int(v[0]) < 65536,
    "--tensor-parallel-size": _int,
    "--gpu-memory-utilization": _fraction,
    "--max-model-len": _int,
    "--max-num-seqs": _int,
    "--max-num-batched-tokens": _int,
    "--limit-mm-per-prompt": _limit_mm,
    "--mm-processor-kwargs": _json_object,
    "--mm-processor-cache-gb": lambda v: len(v) == 1 and float(v[0]) >= 0,
    "--enable-prefix-caching": None,
    "--kv-cache-dtype": lambda v: v in (["auto"], ["fp8"], ["fp8_e4m3"], ["fp8_e5m2"]),
    "--scheduling-policy": lambda v: v in (["fcfs"], ["priority"]),
    "--allowed-media-domains": _hosts,
    "--enable-prompt-tokens-details": None,
    "--dtype": lambda v: v in (["auto"], ["half"], ["float16"], ["bfloat16"], ["float"], ["float32"]),
    "--enable-auto-tool-choice": None,
    "--tool-call-parser": lambda v: len(v) == 1,
}
# Environment variables vLLM reads (vllm/envs.py).
ENVIRONMENT = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": ("0", "1"), "VLLM_API_KEY": None,
               "VLLM_MAX_IMAGE_PIXELS": None, "CUDA_VISIBLE_DEVICES": None,
               # the CPU build's
               "VLLM_TARGET_DEVICE": ("cpu",), "VLLM_CPU_KVCACHE_SPACE": None,
               "VLLM_CPU_OMP_THREADS_BIND": None, "VLLM_CPU_NUM_OF_RESERVED_CPU": None}


def check(argv: list[str], env: dict[str, str]) -> list[str]:
    """Problems with a `vllm serve` command line, flag by flag (empty when it is right)."""
    problems = []
    if argv[1:4] != ["-m", "vllm.entrypoints.cli.main", "serve"] or len(argv) < 5 or argv[4].startswith("-"):
        problems.append("must start with: PYTHON -m vllm.entrypoints.cli.main serve MODEL")
    index = 5
    while index < len(argv):
        flag = argv[index]
        values = []
        index += 1
        while index < len(argv) and not argv[index].startswith("--"):
            values.append(argv[index])
            index += 1
        if flag not in DOCUMENTED:
            problems.append(f"{flag} is not a documented vllm serve flag")
            continue
        rule = DOCUMENTED[flag]
        if rule is None and values:
            problems.append(f"{flag} takes no value, got {values}")
        elif rule is not None:
            try:
                ok = bool(values) and rule(values)
            except (ValueError, TypeError):
                ok = False
            if not ok:
                problems.append(f"{flag} has an invalid value {values}")
    for name, value in env.items():
        allowed = ENVIRONMENT.get(name, ...)
        if allowed is ...:
            problems.append(f"{name} is not an environment variable vLLM reads")
        elif allowed is not None and value not in allowed:
            problems.append(f"{name}={value!r} must be one of {allowed}")
    return problems
