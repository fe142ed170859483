"""The simulated engine's front half: a request's checks, its prompt layout and faults."""

import pytest

from controlplane.textcount import MESSAGE_OVERHEAD, count_text_tokens, prompt_text_tokens
from tests.images import data_url, image_bytes
from workers.engines.simulator.engine import EngineRequestError, SimulatedEngine
from workers.engines.simulator.scheduler import CostModel

COST = CostModel(prefill_us_per_token=100, encode_us_per_image_token=50, decode_ms_per_token=1,
                 step_overhead_ms=10)
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def _engine(**kw):
    return SimulatedEngine(served_model_name="vlm", family="qwen2_5_vl",
                           mm_processor_kwargs={"max_pixels": 1003520}, max_num_seqs=4,
                           max_model_len=32768, images_per_prompt=2, cost=COST, **kw)


def _image(color):
    return {"type": "image_url", "image_url": {"url": data_url(image_bytes(640, 480, color=color))}}


def test_the_prompt_layout_places_images_and_adds_up_to_the_prompt_tokens():
    messages = [{"role": "system", "content": "Describe."},
                {"role": "user", "content": [{"type": "text", "text": "one"}, _image((1, 2, 3)),
                                             {"type": "text", "text": "two"}, _image((4, 5, 6))]}]
    prompt = _engine().plan({"messages": messages})
    starts = [at for at, _ in prompt.spans]
    image_tokens = [image.tokens for _, image in prompt.spans]
    assert prompt.tokens == prompt_text_tokens(messages) + sum(image_tokens)
    assert starts[1] == starts[0] + image_tokens[0] + 1  # "two" is one token
    assert len(prompt.block_keys) == prompt.tokens // 16  # one key per full KV block


def test_block_keys_follow_the_prompts_tokens_images_and_cache_salt():
    engine = _engine()
    system = {"role": "system", "content": "You describe images in one short sentence. " * 4}

    def keys(color=(7, 7, 7), **body):
        user = {"role": "user", "content": [_image(color), {"type": "text", "text": "x"}]}
        return engine.plan({"messages": [system, user], **body}).block_keys

    same = keys()
    assert same == keys()
    shared = (MESSAGE_OVERHEAD * 2 + count_text_tokens(system["content"])) // 16  # before the image
    other = keys((8, 8, 8))
    assert other[:shared] == same[:shared] and set(other[shared:]).isdisjoint(same)
    assert keys(cache_salt="tenant-a")[0] != same[0] != keys(cache_salt="tenant-b")[0]


def test_the_block_size_is_the_engines():
    prompt = _engine(block_size=128).plan({"messages": [{"role": "user", "content": [_image((1, 1, 1))]}]})
    assert prompt.tokens > 128 and len(prompt.block_keys) == prompt.tokens // 128


def test_every_image_of_every_request_queries_the_processor_cache_before_scheduling():
    engine = _engine()
    body = {"messages": [{"role": "user", "content": [_image((5, 5, 5)), _image((6, 6, 6))]}]}
    engine.plan(body)
    engine.plan(body)  # the same images, processed before: hits, whatever the KV caches hold
    counters = engine.metrics.counters
    assert (counters["vllm:mm_cache_queries_total"], counters["vllm:mm_cache_hits_total"]) == (4, 2)


def test_the_reply_is_deterministic():
    engine = _engine()
    body = {"messages": [{"role": "user", "content": "same words"}]}
    assert engine.reply_tokens(body, [], 100) == engine.reply_tokens(body, [], 100)


@pytest.mark.parametrize("body, message", [
    ({"priority": "high"}, "priority must be an integer"),
    ({"cache_salt": 5}, "cache_salt"),
    ({"messages": ["not an object"]}, "object"),
])
def test_invalid_scheduling_fields_are_refused(body, message):
    with pytest.raises(EngineRequestError, match=message):
        _engine().plan({"messages": [{"role": "user", "content": "hi"}], **body})


def test_priority_is_taken_under_the_priority_policy():
    engine = _engine(scheduling_policy="priority")
    assert engine.plan({"messages": [{"role": "user", "content": "hi"}], "priority": -3}).priority == -3


def test_it_accepts_and_ignores_priority_under_fcfs_as_vllm_0_32_does():
    assert _engine().plan({"messages": HI, "priority": 5}).priority == 0


def test_max_model_len_shrinks_to_the_kv_cache():
    assert _engine(kv_cache_tokens=1000).max_model_len == 992


@pytest.mark.parametrize("mode, factor, rate", [
    ("explode", None, None), ("slow", 0, None), ("slow", -1, None), ("error_rate", None, 1.5),
    ("slow", "fast", None), ("slow", float("nan"), None),
])
def test_invalid_faults_are_refused(mode, factor, rate):
    with pytest.raises(EngineRequestError):
        _engine().set_fault(mode, factor, rate)


def test_a_fault_is_set_and_cleared():
    engine = _engine()
    assert engine.set_fault("slow", 3).factor == 3.0 and engine.faults.mode == "slow"
    assert engine.set_fault("none").mode == "none"


def _refusal(engine, **body):
    with pytest.raises(EngineRequestError) as refused:
        engine.plan({"messages": HI, **body})
    return str(refused.value), refused.value.parameter


@pytest.mark.parametrize("body, message, parameter", [
    ({"stream_options": {"include_usage": True}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": False}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "stream_options"),
    ({"top_logprobs": 2},
     "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)", "top_logprobs"),
    ({"top_logprobs": 2, "logprobs": False},
     "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)", "top_logprobs"),
])
def test_it_refuses_the_options_vllm_refuses_naming_the_parameter(body, message, parameter):
    assert _refusal(_engine(), **body) == (message, parameter)


@pytest.mark.parametrize("body", [
    {"stream": True, "stream_options": {"include_usage": True}},
    {"logprobs": True, "top_logprobs": 2},
    {"top_logprobs": 0},
    {"tools": TOOLS, "tool_choice": "none"},
])
def test_it_takes_the_same_options_where_vllm_takes_them(body):
    assert _engine().plan({"messages": HI, **body}).tokens == prompt_text_tokens(HI)


@pytest.mark.parametrize("body", [{"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}])
def test_it_refuses_auto_tool_choice_unless_launched_with_a_tool_parser(body):
    message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    assert _refusal(_engine(), **body) == (message, None)
    assert _engine(auto_tool_choice=True).plan({"messages": HI, **body}).tokens > 0


def test_it_refuses_an_image_over_vllm_max_image_pixels_before_counting_its_tokens():
    # 6000x20 is past Qwen-VL's aspect ratio limit: counting its tokens would fail otherwise.
    wide = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(6000, 20))}}]}]
    message, parameter = _refusal(_engine(max_image_pixels=119_999), messages=wide)
    assert message == ("Image dimensions 6000x20 (120000 pixels) exceed the maximum of 119999 pixels. "
                       "Set VLLM_MAX_IMAGE_PIXELS to increase this limit.")
    assert parameter is None
    at_the_limit = _engine(max_image_pixels=640 * 480)
    assert at_the_limit.plan({"messages": [{"role": "user", "content": [_image((9, 9, 9))]}]}).spans
