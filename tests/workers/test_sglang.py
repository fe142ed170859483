"""Tiers on SGLang, checked against the real `sglang` package in its engine environment
(`make test` installs it; SGLang serves on GPUs only, so nothing here starts its server): its
own argument parser takes every command the launcher builds, its environment defines the
variables the launcher sets, its server defines the endpoints and metric names the product
reads and the simulator imitates, and its image processor, given the launcher's bounds,
cuts images into the tokens the gateway counts."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.catalog.engine_settings import BY_KEY, EngineSettings
from controlplane.fleet.engine_metrics import SGLANG_NAMES
from controlplane.imaging.tokens import count_image_tokens, engine_image_tokens
from workers.engines import sglang_server
from workers.engines.launch import SGLANG_SERVER, LaunchSpec, build_command
from workers.engines.simulator.metrics import Metrics
from workers.engines.simulator.server import SGLANG_ROUTES
from workers.supervision import compat

# One worker takes the module: importing SGLang's server arguments takes seconds, so what
# needs SGLang itself runs in one process (`sglang_answers`).
pytestmark = pytest.mark.xdist_group("sglang")

SETTINGS = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.85, "max_model_len": 16384,
            "max_num_seqs": 24, "max_num_batched_tokens": 4096, "kv_cache_dtype": "fp8_e5m2",
            "dtype": "bfloat16", "enable_prefix_caching": False, "tool_call_parser": "qwen25"}
SIZES = [(4032, 3024), (1000, 1000), (300, 200), (28, 5000), (1920, 1080)]


def sglang_spec(sglang_python, **changes) -> LaunchSpec:
    fields = {"engine_kind": "sglang", "model_id": "Qwen/Qwen2.5-VL-7B-Instruct", "served_model_name": "vlm-flagship",
              "family": "qwen2_5_vl", "host": "0.0.0.0", "port": 8123, "gpu_indices": (0, 1),
              "settings": EngineSettings.parse(SETTINGS, "sglang"), "images_per_prompt": 3,
              "processor_kwargs": {"min_pixels": 3136, "max_pixels": 1003520}, "api_key": "engine-secret",
              "allowed_media_domains": ("images.example.com",), "sglang_python": str(sglang_python)}
    return LaunchSpec(**{**fields, **changes})


def text_spec(sglang_python) -> LaunchSpec:
    return sglang_spec(sglang_python, family="qwen2", model_id="Qwen/Qwen2.5-7B-Instruct", images_per_prompt=None,
                       processor_kwargs={}, settings=EngineSettings.parse({}, "sglang"), api_key=None)


# Run by SGLang's environment: the launcher program's own check on each case, the values
# SGLang's parser makes of each command, and the image grids of SGLang's Qwen-VL path.
# SGLang's Qwen-VL path calls the model's image processor with --mm-process-config's "image"
# options (base_processor.py: self.image_config; qwen_vl.py: processor.image_processor(images=...,
# **image_kwargs)). Qwen2.5-VL's published preprocessor_config.json allows 12,845,056 pixels.
IN_SGLANG = r'''
import argparse, contextlib, importlib.util, io, json, os, sys
from importlib.metadata import version
case = json.load(sys.stdin)
spec = importlib.util.spec_from_file_location("sglang_server", case["server"])
server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server)
found = {"version": version("sglang"), "checks": {}, "parsed": {}}
for name, check in case["checks"].items():
    os.environ[server.VARIABLES_TO_CHECK] = check["variables"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = server.check(check["argv"])
    found["checks"][name] = {"code": code, "out": out.getvalue(), "err": err.getvalue()}
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
for name, argv in case["parse"].items():
    found["parsed"][name] = {key: value for key, value in vars(parser.parse_args(argv)).items()
                             if key in case["keys"]}
from PIL import Image
from transformers import Qwen2VLImageProcessor
processor = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2)
for name, image_config in (("launched", case["image_config"]), ("unbounded", {})):
    found[name] = [processor(images=[Image.new("RGB", tuple(size))], return_tensors="pt",
                             **image_config)["image_grid_thw"].tolist()[0] for size in case["sizes"]]
print(json.dumps(found))
'''
KEYS = ("model_path", "served_model_name", "host", "port", "tp_size", "mem_fraction_static", "context_length",
        "max_running_requests", "chunked_prefill_size", "kv_cache_dtype", "dtype", "disable_radix_cache",
        "enable_metrics", "enable_cache_report", "limit_mm_data_per_request", "mm_process_config",
        "allowed_media_domains", "api_key", "tool_call_parser")


@pytest.fixture(scope="module")
def commands(sglang_python):
    return {"vision": build_command(sglang_spec(sglang_python)), "text": build_command(text_spec(sglang_python))}


@pytest.fixture(scope="module")
def sglang_answers(sglang_python, commands):
    (vision, env), (text, text_env) = commands["vision"], commands["text"]
    checks = {
        "vision": {"argv": vision[2:], "variables": env["VLMCP_SGLANG_VARIABLES"]},
        "text": {"argv": text[2:], "variables": text_env["VLMCP_SGLANG_VARIABLES"]},
        "vllm flag": {"argv": [*vision[2:], "--max-num-seqs", "8"], "variables": ""},
        "vllm kv type": {"argv": [*vision[2:], "--kv-cache-dtype", "fp8"], "variables": ""},
        "unknown variable": {"argv": vision[2:], "variables": "SGLANG_NO_SUCH_SETTING"},
    }
    case = {"server": str(SGLANG_SERVER), "checks": checks, "keys": KEYS, "sizes": SIZES,
            # as the launcher program hands them to SGLang: the key moved in from the environment
            "parse": {"vision": sglang_server.arguments(vision[2:], dict(env))},
            "image_config": json.loads(vision[vision.index("--mm-process-config") + 1])["image"]}
    result = subprocess.run([str(sglang_python), "-c", IN_SGLANG], input=json.dumps(case), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def package(sglang_python) -> Path:
    """SGLang's source directory, found without importing it."""
    purelib = subprocess.run([str(sglang_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return Path(purelib) / "sglang"


def test_sglangs_own_parser_takes_the_command_with_every_setting_and_the_policy(sglang_answers, commands):
    argv, _ = commands["vision"]
    assert sglang_answers["checks"]["vision"]["code"] == 0
    assert sglang_answers["parsed"]["vision"] == {
        "model_path": "Qwen/Qwen2.5-VL-7B-Instruct", "served_model_name": "vlm-flagship", "host": "0.0.0.0",
        "port": 8123, "tp_size": 2, "mem_fraction_static": 0.85, "context_length": 16384,
        "max_running_requests": 24, "chunked_prefill_size": 4096, "kv_cache_dtype": "fp8_e5m2",
        "dtype": "bfloat16", "disable_radix_cache": True, "enable_metrics": True, "enable_cache_report": True,
        "limit_mm_data_per_request": {"image": 3, "video": 0},
        "mm_process_config": {"image": {"size": {"shortest_edge": 3136, "longest_edge": 1003520}}},
        "allowed_media_domains": ["images.example.com"], "api_key": "engine-secret", "tool_call_parser": "qwen25"}
    assert "engine-secret" not in argv


def test_a_text_tier_with_defaults_is_taken_too(sglang_answers):
    assert sglang_answers["checks"]["text"]["code"] == 0


def test_the_launch_check_says_why_sglang_would_not_start(sglang_answers, sglang_python, commands):
    checks = sglang_answers["checks"]
    assert "unrecognized arguments: --max-num-seqs" in checks["vllm flag"]["err"]
    assert "invalid choice: 'fp8'" in checks["vllm kv type"]["err"]
    assert "defines no environment variable SGLANG_NO_SUCH_SETTING" in checks["unknown variable"]["err"]
    assert all(check["code"] == 2 for name, check in checks.items() if name not in ("vision", "text"))
    # as the node agent asks it, in a process of its own with the launch's environment
    argv, env = commands["vision"]
    assert compat.sglang_refusal(argv, env) is None
    assert "SGLang is not installed" in compat.sglang_refusal([sys.executable, *argv[1:]], env)
    assert "does not exist" in compat.sglang_refusal(["/nonexistent/python", *argv[1:]], env)


def test_the_installed_sglang_is_a_release_the_launcher_was_checked_against(sglang_answers):
    assert sglang_answers["version"] in compat.SGLANG_CHECKED
    assert json.loads(sglang_answers["checks"]["vision"]["out"]) == {"sglang": sglang_answers["version"]}


def test_every_tool_call_parser_offered_for_sglang_is_one_it_has(package):
    tree = ast.parse((package / "srt/function_call/parser_names.py").read_text())
    names = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and node.targets[0].id == "TOOL_CALL_PARSER_NAMES")
    assert set(BY_KEY["tool_call_parser"].choices_for("sglang")) <= set(names)


def test_the_metric_names_read_from_sglang_are_the_ones_it_exports(package):
    source = (package / "srt/observability/metrics_collector.py").read_text()
    defined = set(re.findall(r'name="(sglang:[a-z0-9_]+)"', source))
    assert set(SGLANG_NAMES.values()) <= defined
    # and every sample the simulator shows under SGLang's names
    shown = {re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0])
             for line in Metrics("vlm").render("sglang").splitlines() if not line.startswith("#")}
    assert shown - defined == set()


def test_the_simulators_sglang_endpoints_are_sglangs(package):
    source = (package / "srt/entrypoints/http_server.py").read_text()
    routes = set(re.findall(r'@app\.(?:get|post|api_route)\(\s*"([^"]+)"', source))
    assert {*SGLANG_ROUTES, "/health", "/v1/chat/completions", "/v1/models"} <= routes
    assert 'Mount("/metrics"' in (package / "srt/utils/common.py").read_text()
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" in source  # what the launcher turns off
    # SGLang's usage names the image placeholders `image_tokens`, which the gateway reads
    assert "image_tokens: Optional[int]" in (package / "srt/entrypoints/openai/protocol.py").read_text()


def test_every_family_said_to_run_on_sglang_has_its_architecture_there(package):
    classes = set()
    for path in (package / "srt/models").glob("*.py"):
        classes.update(re.findall(r"^class (\w+)\(", path.read_text(), re.M))
    assert set(compat.SGLANG_ARCHITECTURES.values()) - classes == set()


def test_sglangs_processor_given_the_launchers_bounds_makes_the_tokens_the_gateway_counts(sglang_answers):
    def counted(width, height):  # the gateway's count, less the two vision markers around the pads
        return engine_image_tokens("qwen2_5_vl", count_image_tokens("qwen2_5_vl", width, height, min_pixels=3136,
                                                                    max_pixels=1003520))

    for (width, height), (t, h, w) in zip(SIZES, sglang_answers["launched"], strict=True):
        assert t * h * w // 4 == counted(width, height), (width, height)
    assert sglang_answers["launched"][0] == [1, 60, 82]  # a 12 MP photo at 840 x 1148
    # without the bounds the same photo costs SGLang ten times what the policy allows
    t, h, w = sglang_answers["unbounded"][0]
    assert t * h * w // 4 > 10 * counted(4032, 3024)
