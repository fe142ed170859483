"""The prompt laid out with a model's own tokenizer and chat template (controlplane.prompts).
The tokenizer is the tiny Qwen2.5-VL's, trained here; tests/system/test_real_engine.py checks
the same layouts against the real vLLM."""

from __future__ import annotations

import pytest

from controlplane.prompts import ChatTokenizer, TemplateError
from workers.engines.cpu import tiny_model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    tiny_model.build_tokenizer(directory)
    return ChatTokenizer((directory / "tokenizer.json").read_text(), tiny_model.CHAT_TEMPLATE)


def _ids(qwen, messages):
    return qwen.tokenizer.encode(qwen.render(messages), add_special_tokens=False).ids


def image_message(*texts_and_images):
    parts = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": "x"}}
             for p in texts_and_images]
    return [{"role": "user", "content": parts}]


def test_it_counts_the_default_system_turn_and_every_frame_token(qwen):
    messages = [{"role": "user", "content": "hello world"}]
    rendered = qwen.render(messages)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert rendered.endswith("<|im_start|>assistant\n")
    layout = qwen.layout(messages, [], markers=2)
    assert layout.prompt_tokens == layout.text_tokens == len(_ids(qwen, messages))


def test_an_image_starts_at_its_vision_start_marker_and_grows_the_prompt_by_its_tokens(qwen):
    messages = image_message("What is in this picture?", None)
    ids = _ids(qwen, messages)
    start = ids.index(qwen.tokenizer.token_to_id("<|vision_start|>"))
    layout = qwen.layout(messages, [1198], markers=2)
    assert layout.image_positions == (start,)
    # The three template tokens (start, pad, end) become the image's 1198 positions.
    assert layout.prompt_tokens == len(ids) - 3 + 1198
    assert layout.text_tokens == layout.prompt_tokens - 1198


def test_later_images_are_placed_after_the_earlier_ones_grew(qwen):
    layout = qwen.layout(image_message(None, "and", None), [100, 50], markers=2)
    first, second = layout.image_positions
    assert second - first == 100 + len(qwen.tokenizer.encode("and", add_special_tokens=False).ids)


def test_a_request_whose_images_the_template_does_not_place_is_refused(qwen):
    with pytest.raises(TemplateError, match="placed 1 images where the request has 2"):
        qwen.layout(image_message(None), [10, 10], markers=2)


def test_a_template_that_raises_says_so(qwen):
    strict = ChatTokenizer(qwen.tokenizer.to_str(), "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="roles must alternate"):
        strict.layout([{"role": "user", "content": "hi"}], [], markers=2)
