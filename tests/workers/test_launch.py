"""The engine command line: `vllm serve` on GPU hosts, the simulator elsewhere with the same
flags, SGLang's server with its own."""

import json
import sys

import pytest

from controlplane.catalog.engine_settings import EngineSettings, EngineSettingsError, applicable
from workers.engines.launch import LaunchSpec, build_command
from workers.engines.simulator.__main__ import parse_args

ALL_SETTINGS = {
    "tensor_parallel_size": 2,
    "gpu_memory_utilization": 0.85,
    "max_model_len": 32768,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 8192,
    "mm_processor_cache_gb": 4,
    "kv_cache_dtype": "fp8",
    "scheduling_policy": "priority",
    "dtype": "bfloat16",
    "prefill_us_per_token": 50,
    "decode_ms_per_token": 12.5,
    "encode_us_per_image_token": 30,
}


def vision_spec(engine_kind="vllm", **changes):
    fields = {
        "engine_kind": engine_kind,
        "model_id": "Qwen/Qwen2.5-VL-7B-Instruct",
        "served_model_name": "vlm-flagship",
        "family": "qwen2_5_vl",
        "host": "127.0.0.1",
        "port": 8101,
        "gpu_indices": (2, 3),
        "settings": dict(ALL_SETTINGS),
        "images_per_prompt": 4,
        "processor_kwargs": {"min_pixels": 3136, "max_pixels": 1003520},
        "max_input_pixels": 50_000_000,
    }
    fields.update(changes)
    fields["settings"] = EngineSettings.parse(applicable(fields["settings"], engine_kind), engine_kind)
    return LaunchSpec(**fields)


def flag_value(argv, flag):
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_vllm_command_runs_vllm_serve_with_the_model():
    argv, _ = build_command(vision_spec(vllm_python="/engines/vllm/bin/python"))
    assert argv[:5] == ["/engines/vllm/bin/python", "-m", "vllm.entrypoints.cli.main", "serve",
                        "Qwen/Qwen2.5-VL-7B-Instruct"]


def test_vllm_command_names_port_and_parallelism():
    argv, _ = build_command(vision_spec())
    assert flag_value(argv, "--served-model-name") == "vlm-flagship"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8101"
    assert flag_value(argv, "--tensor-parallel-size") == "2"
    assert float(flag_value(argv, "--gpu-memory-utilization")) == 0.85
    assert flag_value(argv, "--max-model-len") == "32768"
    assert flag_value(argv, "--max-num-seqs") == "16"
    assert flag_value(argv, "--max-num-batched-tokens") == "8192"
    assert flag_value(argv, "--dtype") == "bfloat16"


def test_vllm_command_limits_images_and_sets_the_processor_pixels():
    argv, _ = build_command(vision_spec())
    # No video: vLLM would otherwise reserve encoder budget for one the gateway never sends.
    assert json.loads(flag_value(argv, "--limit-mm-per-prompt")) == {"image": 4, "video": 0}
    assert json.loads(flag_value(argv, "--mm-processor-kwargs")) == {
        "min_pixels": 3136, "max_pixels": 1003520}
    assert flag_value(argv, "--mm-processor-cache-gb") == "4"


def test_vllm_command_enables_prefix_caching_and_prompt_token_details():
    argv, _ = build_command(vision_spec())
    assert "--enable-prefix-caching" in argv
    assert "--enable-prompt-tokens-details" in argv


def test_prefix_caching_can_be_turned_off():
    settings = dict(ALL_SETTINGS, enable_prefix_caching=False)
    argv, _ = build_command(vision_spec(settings=settings))
    assert "--enable-prefix-caching" not in argv


def test_fp8_kv_cache_and_priority_scheduling_when_set():
    argv, _ = build_command(vision_spec())
    assert flag_value(argv, "--kv-cache-dtype") == "fp8"
    assert flag_value(argv, "--scheduling-policy") == "priority"


def test_unset_settings_emit_no_flags_but_gpu_memory_and_priority_stay_explicit():
    argv, _ = build_command(vision_spec(settings={}))
    for flag in ("--kv-cache-dtype", "--tensor-parallel-size", "--max-model-len", "--dtype"):
        assert flag not in argv
    assert not any(arg.startswith("--sim-") for arg in argv)
    # vLLM's own default moved from 0.9 to 0.92 in 0.20: the launcher never leaves it implicit.
    assert flag_value(argv, "--gpu-memory-utilization") == "0.9"
    # Text ahead of images unless the operator says otherwise.
    assert flag_value(argv, "--scheduling-policy") == "priority"
    argv, _ = build_command(vision_spec(settings={"scheduling_policy": "fcfs"}))
    assert flag_value(argv, "--scheduling-policy") == "fcfs"


def test_sglang_schedules_text_first_with_vllms_order_of_priorities():
    argv, _ = build_command(sglang_spec(settings={}))
    assert "--enable-priority-scheduling" in argv and "--schedule-low-priority-values-first" in argv
    assert flag_value(argv, "--default-priority-value") == "0"
    argv, _ = build_command(sglang_spec(settings={"scheduling_policy": "fcfs"}))
    assert "--enable-priority-scheduling" not in argv


def test_an_external_engine_is_never_sent_priorities_it_was_not_started_for():
    assert EngineSettings.parse({}, "external").scheduling_policy is None
    assert EngineSettings.parse({}, "vllm").scheduling_policy == "priority"
    assert EngineSettings.parse({}, "vllm").stored() == {}  # a default, not a choice stored


def test_vllm_command_never_gets_simulator_cost_flags():
    with pytest.raises(EngineSettingsError, match="decode_ms_per_token: does not apply to vllm engines"):
        EngineSettings.parse(ALL_SETTINGS, "vllm")
    argv, _ = build_command(vision_spec())
    assert not any(arg.startswith("--sim-") for arg in argv)


def test_environment_pins_gpus_and_blocks_media_redirects():
    _, env = build_command(vision_spec())
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    assert env["VLLM_MAX_IMAGE_PIXELS"] == "50000000"


def test_environment_without_a_pixel_limit_omits_it():
    _, env = build_command(vision_spec(max_input_pixels=None, gpu_indices=(0,)))
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "VLLM_MAX_IMAGE_PIXELS" not in env


def test_text_tier_gets_no_multimodal_flags():
    spec = vision_spec(model_id="Qwen/Qwen2.5-7B-Instruct", family="qwen2", images_per_prompt=None,
                       processor_kwargs={}, allowed_media_domains=("cdn.example",))
    argv, _ = build_command(spec)
    assert "--limit-mm-per-prompt" not in argv
    assert "--mm-processor-kwargs" not in argv
    assert "--allowed-media-domains" not in argv
    assert "--enable-prompt-tokens-details" in argv


def test_media_domains_and_api_key_are_passed_through():
    spec = vision_spec(allowed_media_domains=("a.example", "b.example"), api_key="engine-secret")
    argv, env = build_command(spec)
    start = argv.index("--allowed-media-domains")
    assert argv[start + 1:start + 3] == ["a.example", "b.example"]
    # The key goes in the environment vLLM reads, never on the command line `ps` shows.
    assert env["VLLM_API_KEY"] == "engine-secret"
    assert "engine-secret" not in argv and "--api-key" not in argv


def test_a_family_whose_processor_takes_no_pixel_bounds_gets_no_processor_kwargs():
    argv, _ = build_command(vision_spec(family="llava_next", processor_kwargs={}))
    assert "--mm-processor-kwargs" not in argv
    assert "--limit-mm-per-prompt" in argv


def test_simulator_command_runs_the_simulator_module_with_the_family():
    argv, env = build_command(vision_spec("simulator", gpu_indices=()))
    assert argv[:4] == [sys.executable, "-m", "workers.engines.simulator",
                        "Qwen/Qwen2.5-VL-7B-Instruct"]
    assert flag_value(argv, "--family") == "qwen2_5_vl"
    assert flag_value(argv, "--sim-prefill-us-per-token") == "50"
    assert flag_value(argv, "--sim-decode-ms-per-token") == "12.5"
    assert flag_value(argv, "--sim-encode-us-per-image-token") == "30"
    assert "vllm" not in argv[:3]
    assert env["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("kind", ["external", "VLLM", ""])
def test_unknown_engine_kind_is_refused(kind):
    with pytest.raises(ValueError, match="cannot be launched"):
        build_command(vision_spec(kind))


def test_simulator_accepts_every_flag_build_command_emits(monkeypatch):
    spec = vision_spec("simulator", allowed_media_domains=("a.example", "b.example"),
                       api_key="engine-secret")
    argv, env = build_command(spec)
    assert argv[1:3] == ["-m", "workers.engines.simulator"]

    monkeypatch.setenv("VLLM_API_KEY", env["VLLM_API_KEY"])  # as the spawned engine sees it
    args = parse_args(argv[3:])  # SystemExit here would mean an unknown flag

    assert args.model == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert args.family == "qwen2_5_vl"
    assert args.served_model_name == "vlm-flagship"
    assert (args.host, args.port) == ("127.0.0.1", 8101)
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (32768, 16, 8192)
    assert args.limit_mm_per_prompt == {"image": 4, "video": 0}
    assert args.mm_processor_kwargs == {"min_pixels": 3136, "max_pixels": 1003520}
    assert args.allowed_media_domains == ["a.example", "b.example"]
    assert args.api_key == "engine-secret"
    assert args.enable_prefix_caching and args.enable_prompt_tokens_details
    assert args.kv_cache_dtype == "fp8" and args.scheduling_policy == "priority"
    assert (args.sim_prefill_us_per_token, args.sim_decode_ms_per_token,
            args.sim_encode_us_per_image_token) == (50.0, 12.5, 30.0)


def test_simulator_accepts_a_text_tier_command():
    spec = vision_spec("simulator", family="qwen2", images_per_prompt=None, processor_kwargs={},
                       settings={})
    argv, _ = build_command(spec)
    args = parse_args(argv[3:])
    assert args.limit_mm_per_prompt is None
    assert args.family == "qwen2"


def sglang_spec(**changes):
    settings = {**ALL_SETTINGS, "kv_cache_dtype": "fp8_e4m3", **changes.pop("settings", {})}
    return vision_spec("sglang", settings=settings, sglang_python="/opt/sglang/bin/python", **changes)


def test_sglang_command_runs_sglangs_server_with_the_tiers_settings():
    argv, env = build_command(sglang_spec())
    assert argv[0] == "/opt/sglang/bin/python" and argv[1].endswith("workers/engines/sglang_server.py")
    assert flag_value(argv, "--model-path") == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert flag_value(argv, "--served-model-name") == "vlm-flagship"
    assert (flag_value(argv, "--host"), flag_value(argv, "--port")) == ("127.0.0.1", "8101")
    assert flag_value(argv, "--tp-size") == "2"
    assert flag_value(argv, "--mem-fraction-static") == "0.85"
    assert flag_value(argv, "--context-length") == "32768"
    assert flag_value(argv, "--max-running-requests") == "16"
    assert flag_value(argv, "--chunked-prefill-size") == "8192"
    assert flag_value(argv, "--kv-cache-dtype") == "fp8_e4m3"
    assert "--enable-metrics" in argv and "--enable-cache-report" in argv
    assert "--disable-radix-cache" not in argv
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    # none of vLLM's flags
    assert not [a for a in argv if a in ("--max-model-len", "--max-num-seqs", "--mm-processor-kwargs",
                                         "--enable-prefix-caching", "--scheduling-policy")]


def test_sglang_command_takes_the_policys_image_count_and_pixel_bounds():
    argv, _ = build_command(sglang_spec())
    assert json.loads(flag_value(argv, "--limit-mm-data-per-request")) == {"image": 4, "video": 0}
    assert json.loads(flag_value(argv, "--mm-process-config")) == {
        "image": {"size": {"shortest_edge": 3136, "longest_edge": 1003520}}}
    assert flag_value(argv, "--allowed-media-domains") == "no-engine-fetching.invalid"


def test_sglang_gets_its_api_key_from_the_environment_never_the_command_line():
    argv, env = build_command(sglang_spec(api_key="engine-secret"))
    assert "engine-secret" not in " ".join(argv) and "--api-key" not in argv
    assert env["VLMCP_ENGINE_API_KEY"] == "engine-secret"
    # health answers without generating: supervision sends its own probe
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert env["VLMCP_SGLANG_VARIABLES"] == "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def test_sglang_without_prefix_caching_disables_its_radix_cache():
    argv, _ = build_command(sglang_spec(settings={"enable_prefix_caching": False}))
    assert "--disable-radix-cache" in argv


def test_an_sglang_text_tier_gets_no_multimodal_flags_and_unset_settings_none():
    argv, _ = build_command(vision_spec("sglang", family="qwen2", images_per_prompt=None, processor_kwargs={},
                                        settings={}))
    assert not [a for a in argv if "mm" in a or "media" in a]
    assert flag_value(argv, "--context-length") == "32768"  # always: the gateway admits against it
    for flag in ("--tp-size", "--mem-fraction-static", "--max-running-requests", "--kv-cache-dtype"):
        assert flag not in argv


def test_settings_sglang_has_no_equal_of_are_refused_by_name():
    with pytest.raises(EngineSettingsError) as refused:
        EngineSettings.parse({"kv_cache_dtype": "fp8", "tool_call_parser": "llama3_json",
                              "mm_processor_cache_gb": 2}, "sglang")
    assert set(refused.value.messages) == {"kv_cache_dtype", "tool_call_parser", "mm_processor_cache_gb"}
    assert "fp8_e4m3" in refused.value.messages["kv_cache_dtype"]
    assert "llama3, mistral" in refused.value.messages["tool_call_parser"]  # SGLang's names
    assert "only vllm, simulator" in refused.value.messages["mm_processor_cache_gb"]


def test_an_sglang_tier_with_a_tool_call_parser_passes_sglangs_name_for_it():
    argv, _ = build_command(sglang_spec(settings={"tool_call_parser": "qwen25"}))
    assert flag_value(argv, "--tool-call-parser") == "qwen25"
    assert "--enable-auto-tool-choice" not in argv  # vLLM's; SGLang has no such flag


def test_the_simulator_can_be_told_to_speak_sglang():
    argv, _ = build_command(vision_spec("simulator", settings={"engine_api": "sglang"}))
    assert parse_args(argv[3:]).api == "sglang"
    with pytest.raises(EngineSettingsError):
        EngineSettings.parse({"engine_api": "sglang"}, "vllm")
