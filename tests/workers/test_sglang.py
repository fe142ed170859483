"""Tiers on SGLang, checked against the real `sglang` package in its engine environment
(`make test` installs it; SGLang serves on GPUs only, so nothing here starts its server): its
own argument parser takes every command the launcher builds, its environment defines the
variables the launcher sets, its server defines the endpoints and metric names the product
reads and the simulator imitates, and its image processor, given the launcher's bounds,
cuts images into the tokens the gateway counts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.catalog.engine_settings import EngineSettings
from controlplane.imaging.tokens import count_image_tokens, engine_image_tokens
from workers.engines import sglang_server
from workers.engines.launch import LaunchSpec, build_command
from workers.engines.metrics import SGLANG_NAMES
from workers.engines.simulator.metrics import Metrics
from workers.engines.simulator.server import SGLANG_ROUTES
from workers.supervision import compat

pytestmark = pytest.mark.xdist_group("sglang")

SETTINGS = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.85, "max_model_len": 16384,
            "max_num_seqs": 24, "max_num_batched_tokens": 4096, "kv_cache_dtype": "fp8_e5m2",
            "dtype": "bfloat16", "enable_prefix_caching": False}


def sglang_spec(sglang_python, **changes) -> LaunchSpec:
    fields = {"engine_kind": "sglang", "model_id": "Qwen/Qwen2.5-VL-7B-Instruct", "served_model_name": "vlm-flagship",
              "family": "qwen2_5_vl", "host": "0.0.0.0", "port": 8123, "gpu_indices": (0, 1),
              "settings": EngineSettings.parse(SETTINGS, "sglang"), "images_per_prompt": 3,
              "processor_kwargs": {"min_pixels": 3136, "max_pixels": 1003520}, "api_key": "engine-secret",
              "allowed_media_domains": ("images.example.com",), "sglang_python": str(sglang_python)}
    return LaunchSpec(**{**fields, **changes})


def in_sglang(sglang_python, code: str, payload) -> dict:
    result = subprocess.run([str(sglang_python), "-c", code], input=json.dumps(payload), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def package_file(sglang_python, module: str) -> str:
    """A module's source in the SGLang environment, found without importing it."""
    origin = subprocess.run([str(sglang_python), "-c", f"import importlib.util; print(importlib.util.find_spec("
                             f"{module!r}).origin)"], capture_output=True, text=True, check=True).stdout.strip()
    return Path(origin).read_text()


PARSE = r'''
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = vars(parser.parse_args(json.load(sys.stdin)))
keys = ("model_path", "served_model_name", "host", "port", "tp_size", "mem_fraction_static", "context_length",
        "max_running_requests", "chunked_prefill_size", "kv_cache_dtype", "dtype", "disable_radix_cache",
        "enable_metrics", "enable_cache_report", "limit_mm_data_per_request", "mm_process_config",
        "allowed_media_domains", "api_key")
print(json.dumps({key: args[key] for key in keys}))
'''


def test_sglangs_own_parser_takes_the_command_with_every_setting_and_the_policy(sglang_python):
    argv, env = build_command(sglang_spec(sglang_python))
    assert argv[0] == str(sglang_python)
    # as the launcher program hands them to SGLang, the key moved in from the environment
    parsed = in_sglang(sglang_python, PARSE, sglang_server.arguments(argv[2:], dict(env)))
    assert parsed == {
        "model_path": "Qwen/Qwen2.5-VL-7B-Instruct", "served_model_name": "vlm-flagship", "host": "0.0.0.0",
        "port": 8123, "tp_size": 2, "mem_fraction_static": 0.85, "context_length": 16384,
        "max_running_requests": 24, "chunked_prefill_size": 4096, "kv_cache_dtype": "fp8_e5m2",
        "dtype": "bfloat16", "disable_radix_cache": True, "enable_metrics": True, "enable_cache_report": True,
        "limit_mm_data_per_request": {"image": 3, "video": 0},
        "mm_process_config": {"image": {"size": {"shortest_edge": 3136, "longest_edge": 1003520}}},
        "allowed_media_domains": ["images.example.com"], "api_key": "engine-secret"}
    assert "engine-secret" not in argv


def test_a_text_tier_with_defaults_is_taken_too(sglang_python):
    spec = sglang_spec(sglang_python, family="qwen2", model_id="Qwen/Qwen2.5-7B-Instruct", images_per_prompt=None,
                       processor_kwargs={}, settings=EngineSettings.parse({}, "sglang"), api_key=None)
    argv, env = build_command(spec)
    assert compat.sglang_refusal(argv, env) is None


def test_the_launch_check_says_why_sglang_would_not_start(sglang_python):
    argv, env = build_command(sglang_spec(sglang_python))
    assert compat.sglang_refusal(argv, env) is None  # the environment variables are SGLang's
    assert "unrecognized arguments: --max-num-seqs" in compat.sglang_refusal([*argv, "--max-num-seqs", "8"], env)
    assert "invalid choice: 'fp8'" in compat.sglang_refusal([*argv, "--kv-cache-dtype", "fp8"], env)
    refused = compat.sglang_refusal(argv, {**env, "VLMCP_SGLANG_VARIABLES": "SGLANG_NO_SUCH_SETTING"})
    assert "defines no environment variable SGLANG_NO_SUCH_SETTING" in refused
    # a node whose SGLANG_PYTHON has no SGLang
    assert "SGLang is not installed" in compat.sglang_refusal([sys.executable, *argv[1:]], env)


def test_the_installed_sglang_is_a_release_the_launcher_was_checked_against(sglang_python):
    argv, env = build_command(sglang_spec(sglang_python))
    result = subprocess.run([argv[0], argv[1], "--check", *argv[2:]], env=env, capture_output=True, text=True,
                            timeout=300)
    assert json.loads(result.stdout)["sglang"] in compat.SGLANG_CHECKED


def test_the_metric_names_read_from_sglang_are_the_ones_it_exports(sglang_python):
    source = package_file(sglang_python, "sglang.srt.observability.metrics_collector")
    defined = set(re.findall(r'name="(sglang:[a-z0-9_]+)"', source))
    assert set(SGLANG_NAMES.values()) <= defined
    # and every sample the simulator shows under SGLang's names
    metrics = Metrics("vlm")
    shown = {re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0])
             for line in metrics.render("sglang").splitlines() if not line.startswith("#")}
    assert shown - defined == set()


def test_the_simulators_sglang_endpoints_are_sglangs(sglang_python):
    source = package_file(sglang_python, "sglang.srt.entrypoints.http_server")
    routes = set(re.findall(r'@app\.(?:get|post|api_route)\(\s*"([^"]+)"', source))
    assert {*SGLANG_ROUTES, "/health", "/v1/chat/completions", "/v1/models"} <= routes
    assert 'Mount("/metrics"' in package_file(sglang_python, "sglang.srt.utils.common")
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" in source  # what the launcher turns off


def test_every_family_said_to_run_on_sglang_has_its_architecture_there(sglang_python):
    found = subprocess.run([str(sglang_python), "-c", "import importlib.util; print(importlib.util.find_spec("
                            "'sglang.srt.models').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    classes = set()
    for path in Path(found).glob("*.py"):
        classes.update(re.findall(r"^class (\w+)\(", path.read_text(), re.M))
    assert set(compat.SGLANG_ARCHITECTURES.values()) - classes == set()


# SGLang's Qwen-VL path calls the model's image processor with --mm-process-config's "image"
# options (base_processor.py: self.image_config; qwen_vl.py: processor.image_processor(images=...,
# **image_kwargs)). Qwen2.5-VL's published preprocessor_config.json allows 12,845,056 pixels.
GRIDS = r'''
import json, sys
from PIL import Image
from transformers import Qwen2VLImageProcessor
case = json.load(sys.stdin)
processor = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2)
found = {}
for config_name, image_config in (("launched", case["image_config"]), ("unbounded", {})):
    found[config_name] = [processor(images=[Image.new("RGB", tuple(size))], return_tensors="pt",
                                    **image_config)["image_grid_thw"].tolist()[0] for size in case["sizes"]]
print(json.dumps(found))
'''


def test_sglangs_processor_given_the_launchers_bounds_makes_the_tokens_the_gateway_counts(sglang_python):
    argv, _ = build_command(sglang_spec(sglang_python))
    image_config = json.loads(argv[argv.index("--mm-process-config") + 1])["image"]
    sizes = [(4032, 3024), (1000, 1000), (300, 200), (28, 5000), (1920, 1080)]
    grids = in_sglang(sglang_python, GRIDS, {"image_config": image_config, "sizes": sizes})
    def counted(width, height):  # the gateway's count, less the two vision markers around the pads
        return engine_image_tokens("qwen2_5_vl", count_image_tokens("qwen2_5_vl", width, height, min_pixels=3136,
                                                                    max_pixels=1003520))

    for (width, height), (t, h, w) in zip(sizes, grids["launched"], strict=True):
        assert t * h * w // 4 == counted(width, height), (width, height)
    assert grids["launched"][0] == [1, 60, 82]  # a 12 MP photo at 840 x 1148
    # without the bounds the same photo costs SGLang ten times what the policy allows
    t, h, w = grids["unbounded"][0]
    assert t * h * w // 4 > 10 * counted(4032, 3024)
