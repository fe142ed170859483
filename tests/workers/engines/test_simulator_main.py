"""The simulator's command line: `vllm serve` flags and environment, read once at start."""

import pytest

from workers.engines.simulator.__main__ import engine_from_args, parse_args

MODEL = ["m", "--family", "qwen2_5_vl", "--limit-mm-per-prompt", '{"image": 2}']
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def test_it_takes_tools_when_launched_with_auto_tool_choice_and_a_parser():
    engine = engine_from_args(parse_args([*MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]), {})
    assert engine.plan({"messages": HI, "tools": TOOLS}).tokens > 0


def test_it_refuses_to_start_with_auto_tool_choice_but_no_parser(capsys):
    with pytest.raises(SystemExit):
        parse_args([*MODEL, "--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


@pytest.mark.parametrize("environ, limit", [({}, 178_956_970), ({"VLLM_MAX_IMAGE_PIXELS": "50000000"}, 50_000_000),
                                            ({"VLLM_MAX_IMAGE_PIXELS": "0"}, None)])
def test_it_reads_the_image_pixel_limit_from_the_environment(environ, limit):
    assert engine_from_args(parse_args(MODEL), environ).max_image_pixels == limit


def test_it_refuses_to_start_with_an_unreadable_pixel_limit():
    with pytest.raises(SystemExit, match="VLLM_MAX_IMAGE_PIXELS"):
        engine_from_args(parse_args(MODEL), {"VLLM_MAX_IMAGE_PIXELS": "lots"})


def test_it_takes_vllms_block_size_which_defaults_to_a_gpus_16():
    assert engine_from_args(parse_args(MODEL), {}).scheduler.config.block_size == 16
    assert engine_from_args(parse_args([*MODEL, "--block-size", "128"]), {}).scheduler.config.block_size == 128
