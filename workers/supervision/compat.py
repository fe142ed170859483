"""Can this node run this tier? vLLM gained each model architecture in a given release;
launching one on an older vLLM would fail minutes later in a log nobody reads. Refuse it up
front, with the reason on the instance row."""

from __future__ import annotations

import json
import os
import re
import subprocess

# Hugging Face model_type -> (architecture vLLM registers, first vLLM release that serves it).
# Read from the published vLLM packages 0.6.0 ... 0.33.0 (vllm/model_executor/models/registry.py);
# "0.6.0" means "in every release checked", the oldest being 0.6.0.
ARCHITECTURES = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "0.6.1"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "0.7.2"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "0.11.0"),
    "llava": ("LlavaForConditionalGeneration", "0.6.0"),
    "llava_next": ("LlavaNextForConditionalGeneration", "0.6.0"),
    "internvl": ("InternVLChatModel", "0.6.0"),  # the HF-native InternVLForConditionalGeneration: 0.10.2
    "gemma3": ("Gemma3ForConditionalGeneration", "0.8.0"),
    "pixtral": ("PixtralForConditionalGeneration", "0.6.1"),
    "idefics3": ("Idefics3ForConditionalGeneration", "0.6.4"),
    "phi3_v": ("Phi3VForCausalLM", "0.6.0"),
    "qwen2": ("Qwen2ForCausalLM", "0.6.0"),
    "qwen3": ("Qwen3ForCausalLM", "0.8.4"),
    "llama": ("LlamaForCausalLM", "0.6.0"),
    "mistral": ("MistralForCausalLM", "0.6.0"),
}
# Flags the launcher always passes, and the release that introduced them.
FLAGS = {"--mm-processor-cache-gb": "0.10.1", "--allowed-media-domains": "0.11.0"}


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.11.0rc2.dev5+g123' -> (0, 11, 0): release numbers only."""
    numbers = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text or "")
    if numbers is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in numbers.group(1).split("."))


# Hugging Face model_type -> the architecture SGLang registers for it (sglang/srt/models/; the
# tests check each against the installed package). SGLang releases the launcher was checked
# against: their argument parsers take every flag it passes (tests/workers/test_sglang.py).
SGLANG_ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}
SGLANG_CHECKED = ("0.5.23",)
SGLANG_CHECK_TIMEOUT_S = 180


def sglang_refusal(argv: list[str], env: dict[str, str]) -> str | None:
    """Why SGLang on this node would not start with this command, in SGLang's own words
    (its argument parser run by SGLANG_PYTHON, nothing started), or None when it would."""
    python, server, flags = argv[0], argv[1], argv[2:]
    try:
        result = subprocess.run([python, server, "--check", *flags], capture_output=True, text=True,
                                env={**os.environ, **env}, timeout=SGLANG_CHECK_TIMEOUT_S)
    except FileNotFoundError:
        return f"SGLANG_PYTHON {python} does not exist: install SGLang there (make engine-sglang) or set it"
    except subprocess.TimeoutExpired:
        return f"SGLang's argument check did not finish in {SGLANG_CHECK_TIMEOUT_S}s"
    if result.returncode == 0:
        try:
            json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return f"SGLang's argument check printed nothing readable: {result.stdout[-300:]!r}"
        return None
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else f"SGLang's argument check failed (exit {result.returncode})")[:500]


def launch_refusal(tier, node) -> str | None:
    """Why `tier` cannot be launched on `node`, or None when it can."""
    if tier.engine_kind == "sglang":
        if tier.family not in SGLANG_ARCHITECTURES:
            return f"no known SGLang architecture for model family {tier.family!r}"
        return None  # the rest is asked of SGLang itself, with the command (sglang_refusal)
    if tier.engine_kind != "vllm":
        return None
    if not node.vllm_version:
        if tier.runs_on_cpu:
            return (f"vLLM is not installed on node {node.name}: install its CPU build with "
                    "`python -m workers.engines.cpu.install` and give the agent VLLM_PYTHON")
        return f"vLLM is not installed on node {node.name} (pip install 'vlm-serving-controlplane[vllm]')"
    cpu_build = "+cpu" in node.vllm_version
    if tier.runs_on_cpu and not cpu_build:
        return (f"the tier runs on CPU (device: cpu) but node {node.name} has a GPU build of vLLM "
                f"({node.vllm_version}); install vLLM's CPU build there")
    if not tier.runs_on_cpu and cpu_build:
        return (f"node {node.name} has vLLM's CPU build ({node.vllm_version}), which cannot serve "
                "a GPU tier; set device: cpu on the tier or install vLLM's GPU build")
    try:
        installed = version_tuple(node.vllm_version)
    except ValueError:
        return f"node {node.name} reports an unreadable vLLM version {node.vllm_version!r}"
    known = ARCHITECTURES.get(tier.family)
    if known is None:
        return f"no known vLLM architecture for model family {tier.family!r}"
    architecture, minimum = known
    if installed < version_tuple(minimum):
        return (f"{architecture} ({tier.family}) needs vLLM {minimum} or newer; node {node.name} "
                f"has {node.vllm_version}")
    uses = {"--mm-processor-cache-gb": tier.settings.mm_processor_cache_gb is not None,
            "--allowed-media-domains": tier.kind == "vision"}  # always passed to vision engines
    for flag, needed in uses.items():
        if needed and installed < version_tuple(FLAGS[flag]):
            return f"{flag} needs vLLM {FLAGS[flag]} or newer; node {node.name} has {node.vllm_version}"
    return None
