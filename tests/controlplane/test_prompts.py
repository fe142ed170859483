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


# -- the conversation vLLM hands the template, rendered as Hugging Face renders it ------------

TOOLS = [{"type": "function", "function": {"name": "lookup_price", "description": "Price of an item",
                                           "parameters": {"type": "object", "properties": {"item": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now"}}]
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "hello world"}],
    "system and turns": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
                         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    "tool calls with null content": [
        {"role": "user", "content": "What does a pear cost?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup_price", "arguments": '{"item": "pear"}'}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "0.5"}, {"type": "text", "text": "EUR"}]},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"}],
    "images": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                            {"type": "text", "text": "and"},
                                            {"type": "image_url", "image_url": {"url": "y"}}]}],
    "developer": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
                  {"role": "developer", "content": [{"type": "text", "text": "Be polite."}]}],
}


def _hugging_face(qwen, turns, tools, template=None):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=qwen.tokenizer)
    return reference.apply_chat_template(turns, tools=tools, chat_template=template or qwen.chat_template,
                                         add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
def test_it_renders_the_conversation_as_hugging_face_renders_it(qwen, name, tools):
    from controlplane.prompts import conversation, tool_definitions

    turns = conversation(CONVERSATIONS[name], fmt=qwen.content_format, developer_role=qwen.developer_role)
    assert qwen.render(CONVERSATIONS[name], tools=tools) == _hugging_face(qwen, turns, tool_definitions(tools))


def test_it_gives_the_template_what_vllm_gives_it(qwen):
    from controlplane.prompts import conversation

    turns = conversation(CONVERSATIONS["tool calls with null content"], fmt="openai", developer_role=False)
    assert turns[1]["content"] == []  # null content is no parts, not None (the template loops over it)
    # arguments as objects; those that are not JSON become {}
    assert [c["function"]["arguments"] for c in turns[1]["tool_calls"]] == [{"item": "pear"}, {}]
    assert turns[2] == {"role": "tool", "content": "0.5\nEUR", "tool_call_id": "c1"}  # a tool's texts, joined
    rendered = qwen.render(CONVERSATIONS["tool calls with null content"], tools=TOOLS)
    assert '"arguments": {"item": "pear"}' in rendered and '"name": "lookup_price"' in rendered


def test_developer_messages_join_the_system_turn_where_the_template_has_no_developer_role(qwen):
    from controlplane.prompts import conversation

    turns = conversation(CONVERSATIONS["developer"], fmt="openai", developer_role=False)
    assert turns == [{"role": "system", "content": "Answer in French.\n\nBe polite."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    kept = conversation(CONVERSATIONS["developer"], fmt="openai", developer_role=True)
    assert [t["role"] for t in kept] == ["developer", "user", "developer"]


def test_a_template_printing_content_whole_gets_the_text_parts_joined(qwen):
    """A text model's template ("string" content): parts joined by newlines, as vLLM does."""
    from controlplane.prompts import STRING, content_format

    template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert content_format(template) == STRING
    text = ChatTokenizer(qwen.tokenizer.to_str(), template)
    messages = CONVERSATIONS["system and turns"]
    assert "What is \n2+2?" in text.render(messages)
    from controlplane.prompts import conversation

    assert text.render(messages) == _hugging_face(qwen, conversation(messages, fmt=STRING, developer_role=False),
                                                  None, template)


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m.content | reverse %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% set ms = messages[1:] %}{% for m in ms %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}", "openai"),
    ("{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m['content']) }}{% endfor %}", "openai"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for c in m.tool_calls %}{{ c }}{% endfor %}{% endfor %}", "string"),
])
def test_which_content_a_template_takes_is_read_off_its_syntax(template, expected):
    from controlplane.prompts import content_format

    assert content_format(template) == expected


def test_a_template_failing_on_a_request_is_a_template_error_not_a_crash(qwen):
    """A TypeError inside a template (a loop over something that is not a list) is the
    template's failure: the gateway falls back to its estimate instead of answering 500."""
    broken = ChatTokenizer(qwen.tokenizer.to_str(), "{% for m in messages %}{% for p in 3 %}{% endfor %}{% endfor %}")
    with pytest.raises(TemplateError):
        broken.layout([{"role": "user", "content": "hi"}], [], markers=2)
