"""A chat prompt laid out as the model will see it: the conversation prepared as vLLM prepares
it for a Hugging Face chat template, the model's own template rendered in the environment
Hugging Face renders it in, and the result tokenized with the model's own tokenizer (the fast
`tokenizers` library), each image's placeholder expanded to its tokens. Pure Python: no
Django, no Celery.

It gives the exact prompt length the engine will report (so text is reserved against quotas
exactly) and the position where each image starts (so the engine's cached prefix says how
much of each image came from the cache). Where a tier has no tokenizer, or its template fails
on a request, the estimate in `controlplane.textcount` stands in, marked as an estimate.

How vLLM prepares a conversation (what `conversation` does here):
- a template either walks each message's content parts ("openai" content: text parts as
  {"type": "text", "text": ...}, images as {"type": "image"}, a string or missing content as
  a list of parts or an empty list), or prints content as a string ("string" content: the text
  parts joined by newlines, each image's placeholder before them); which one is read off the
  template's syntax tree;
- a tool message's text parts are joined into one string;
- an assistant message's tool calls carry their arguments parsed from JSON into objects
  (arguments that are not a JSON object become {}), and an empty list of calls is dropped;
- only a message's role, content, name, tool calls and tool call id reach the template;
- a template that never names the developer role gets developer messages as system ones,
  merged with the other system messages into one at the start;
- tools are given to the template as {"type": "function", "function": {name, description,
  parameters[, strict]}}.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# The token a Qwen-VL chat template writes once per image, between <|vision_start|> and
# <|vision_end|>, which the processor expands to one token per vision feature.
IMAGE_PLACEHOLDERS = ("<|image_pad|>",)
# What vLLM writes for an image into a template that takes content as a string (Qwen-VL's).
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"
OPENAI, STRING = "openai", "string"


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    prompt_tokens: int  # what the engine will report as prompt_tokens
    text_tokens: int  # prompt_tokens less the images' tokens
    image_positions: tuple[int, ...]  # where each image's tokens start


def _raise(message):
    raise jinja2.TemplateError(message)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (which marks the assistant's tokens for
    training) renders its body, as it does when no one asks for the marks."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As Hugging Face's: not HTML-escaped, with the options templates use.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # The environment chat templates are written for (Hugging Face's): sandboxed, blocks
    # trimmed, loop controls, the generation tag, tojson, raise_exception and strftime_now.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = lambda fmt: dt.datetime.now().strftime(fmt)
    return environment


@lru_cache(maxsize=32)
def _template(source: str) -> jinja2.Template:
    return _environment().from_string(source)


# -- which content a template takes ----------------------------------------------------------

def _unwrapped(node):
    """The variable behind filters, tests and slices: `messages | reverse`, `messages[1:]`."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _is_name(node, names) -> bool:
    node = _unwrapped(node)
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _is_content_of(node, names) -> bool:
    """`message['content']` or `message.content` of one of `names`."""
    node = _unwrapped(node)
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content" and _is_name(node.node, names)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content" and _is_name(node.node, names)
    return False


@lru_cache(maxsize=32)
def content_format(source: str) -> str:
    """OPENAI when the template walks a message's content parts, STRING when it prints the
    content whole (vLLM reads this off the template the same way)."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateError:
        return STRING
    # Names that hold the messages (`messages`, and what is set from it), then the loop
    # variables that walk them.
    lists = {"messages"}
    grew = True
    while grew:
        grew = False
        for assign in tree.find_all(jinja2.nodes.Assign):
            if isinstance(assign.target, jinja2.nodes.Name) and assign.target.name not in lists \
                    and _is_name(assign.node, lists):
                lists.add(assign.target.name)
                grew = True
    messages = {loop.target.name for loop in tree.find_all(jinja2.nodes.For)
                if isinstance(loop.target, jinja2.nodes.Name) and _is_name(loop.iter, lists)}
    # A macro parameter handed a message's content counts as the content.
    in_macros, macro_params = set(), {}
    for macro in tree.find_all(jinja2.nodes.Macro):
        params = set()
        names = [arg.name for arg in macro.args]
        for call in tree.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                params.update(names[i] for i, arg in enumerate(call.args[:len(names)])
                              if _is_content_of(arg, messages))
                params.update(kw.key for kw in call.kwargs if kw.key in names and _is_content_of(kw.value, messages))
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in tree.find_all(jinja2.nodes.For):
        if _is_content_of(loop.iter, messages):
            return OPENAI
        if isinstance(loop.iter, jinja2.nodes.Name) and (
                loop.iter.name in macro_params.get(id(loop), ()) or
                (id(loop) not in in_macros and loop.iter.name == "content")):
            return OPENAI
    return STRING


# -- the conversation as the template receives it ----------------------------------------------

def _parts(content) -> list:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [part for part in content if isinstance(part, dict)]


def _arguments(arguments):
    """A tool call's arguments as the template gets them: an object ({} for anything else)."""
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _tool_calls(calls) -> list | None:
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        call = dict(call) if isinstance(call, dict) else {}
        function = dict(call.get("function") or {})
        function["arguments"] = _arguments(function.get("arguments"))
        call["function"] = function
        out.append(call)
    return out


def conversation(messages: list[dict], *, fmt: str, developer_role: bool) -> list[dict]:
    """OpenAI messages as vLLM hands them to a chat template taking `fmt` content."""
    out = []
    for message in messages:
        role, parts = message.get("role"), _parts(message.get("content"))
        if fmt == OPENAI:
            content = []
            for part in parts:
                if part.get("type") == "text":
                    content.append({"type": "text", "text": str(part.get("text", ""))})
                elif part.get("type") in ("image_url", "input_image"):
                    content.append({"type": "image"})
            if role == "tool" and all(part["type"] == "text" for part in content):
                content = "\n".join(part["text"] for part in content)
        else:
            texts = [str(part.get("text", "")) for part in parts if part.get("type") == "text"]
            images = sum(1 for part in parts if part.get("type") in ("image_url", "input_image"))
            content = "\n".join([IMAGE_PROMPT] * images + (["\n".join(texts)] if texts else []))
        turn = {"role": role, "content": content}
        if role == "assistant" and (calls := _tool_calls(message.get("tool_calls"))) is not None:
            turn["tool_calls"] = calls
        if role == "tool" and "tool_call_id" in message:
            turn["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            turn["name"] = message["name"]
        out.append(turn)
    if not developer_role and any(turn["role"] == "developer" for turn in out):
        out = _merged_system_turns([{**turn, "role": "system"} if turn["role"] == "developer" else turn
                                    for turn in out])
    return out


def _merged_system_turns(turns: list[dict]) -> list[dict]:
    """System turns, once developer ones joined them, merged into one at the start when they
    are not already a single first turn."""
    systems = [(n, turn) for n, turn in enumerate(turns) if turn["role"] == "system"]
    if not systems or (len(systems) == 1 and systems[0][0] == 0):
        return turns
    texts = []
    for _, turn in systems:
        content = turn["content"]
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content if isinstance(part, dict) and "text" in part)
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(t for t in turns if t["role"] != "system")]


def tool_definitions(tools) -> list[dict] | None:
    """The request's tools as vLLM gives them to the template."""
    if not tools:
        return None
    out = []
    for tool in tools:
        function = (tool or {}).get("function") or {}
        definition = {"name": function.get("name"), "description": function.get("description"),
                      "parameters": function.get("parameters")}
        if function.get("strict") is not None:
            definition["strict"] = function["strict"]
        out.append({"type": "function", "function": definition})
    return out


class ChatTokenizer:
    """A model's tokenizer and chat template, as the engine applies them."""

    def __init__(self, tokenizer_json: str, chat_template: str, *, special: dict | None = None):
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.chat_template = chat_template
        self.special = special or {}  # bos_token, eos_token as the template may use them
        self.content_format = content_format(chat_template)
        self.developer_role = '"developer"' in chat_template or "'developer'" in chat_template
        ids = [self.tokenizer.token_to_id(token) for token in IMAGE_PLACEHOLDERS]
        self.placeholder_ids = frozenset(i for i in ids if i is not None)

    def render(self, messages: list[dict], *, tools=None) -> str:
        turns = conversation(messages, fmt=self.content_format, developer_role=self.developer_role)
        try:
            return _template(self.chat_template).render(
                messages=turns, tools=tool_definitions(tools), documents=None, add_generation_prompt=True,
                **self.special)
        except Exception as exc:  # noqa: BLE001 - any failure of a template is its own (a TypeError in a loop too)
            raise TemplateError(f"the chat template failed: {exc}") from None

    def layout(self, messages: list[dict], image_tokens: list[int], *, markers: int, tools=None) -> Layout:
        """The prompt with each image taking `image_tokens[i]` positions, of which `markers`
        are tokens the template writes around its placeholder (they start the image)."""
        if image_tokens and not self.placeholder_ids:
            raise TemplateError("the tokenizer has no image placeholder token")
        ids = self.tokenizer.encode(self.render(messages, tools=tools), add_special_tokens=False).ids
        slots = [index for index, token in enumerate(ids) if token in self.placeholder_ids]
        if len(slots) != len(image_tokens):
            raise TemplateError(f"the chat template placed {len(slots)} images where the request has "
                                f"{len(image_tokens)}")
        positions, grown = [], 0
        for slot, tokens in zip(slots, image_tokens, strict=True):
            # The image starts at its first marker, which the template put right before the
            # placeholder; the placeholder becomes tokens - markers positions.
            positions.append(slot + grown - markers // 2)
            grown += tokens - markers - 1
        prompt = len(ids) + grown
        return Layout(prompt_tokens=prompt, text_tokens=prompt - sum(image_tokens), image_positions=tuple(positions))
