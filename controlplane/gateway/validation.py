"""What a tenant's chat request may hold, checked before anything is done with it: its fields
by name and type, its messages and their parts, and where its images are.

Pure Python (no Django)."""

from __future__ import annotations

from controlplane.imaging.policy import DecodedDataURL


class RequestInvalid(ValueError):
    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


# What a tenant may send. Everything else (vLLM's mm_processor_kwargs, chat_template,
# priority, cache_salt, request ids...) would let a client steer the engine around the
# gateway's policies, so it is refused by name.
REQUEST_FIELDS = frozenset({
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "seed",
    "logprobs", "top_logprobs", "logit_bias", "user", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "top_k", "min_p", "repetition_penalty", "metadata", "store",
    # vLLM's output-length controls (load tests fix output lengths with them); billed as produced.
    "ignore_eos", "min_tokens",
})
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
MAX_MESSAGES, MAX_PARTS = 2048, 4096  # per request: messages, and content parts of all of them
_NUMBER = (int, float)


def _number(low=None, high=None):
    def check(value):
        return isinstance(value, _NUMBER) and not isinstance(value, bool) and \
            (low is None or value >= low) and (high is None or value <= high)
    return check


def _integer(low=None, high=None):
    def check(value):
        return isinstance(value, int) and not isinstance(value, bool) and \
            (low is None or value >= low) and (high is None or value <= high)
    return check


def _stop(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and len(value) <= 16
                                      and all(isinstance(item, str) for item in value))


def _bias(value) -> bool:
    return isinstance(value, dict) and len(value) <= 1024 and all(
        isinstance(k, str) and _number(-100, 100)(v) for k, v in value.items())


# OpenAI's types and ranges for the sampling parameters (vLLM's for its own), checked here so
# that a wrong type is a 400 from the gateway, before anything is reserved.
PARAMETER_TYPES = {
    "temperature": (_number(0, 2), "a number from 0 to 2"),
    "top_p": (_number(0, 1), "a number from 0 to 1"),
    "presence_penalty": (_number(-2, 2), "a number from -2 to 2"),
    "frequency_penalty": (_number(-2, 2), "a number from -2 to 2"),
    "seed": (_integer(-(2**63), 2**64 - 1), "an integer"),
    "stop": (_stop, "a string or an array of at most 16 strings"),
    "logprobs": (lambda v: isinstance(v, bool), "a boolean"),
    "top_logprobs": (_integer(0, 20), "an integer from 0 to 20"),
    "logit_bias": (_bias, "an object of token ids to numbers from -100 to 100"),
    "user": (lambda v: isinstance(v, str) and len(v) <= 256, "a string of at most 256 characters"),
    "response_format": (lambda v: isinstance(v, dict) and isinstance(v.get("type"), str), "an object with a type"),
    "tools": (lambda v: isinstance(v, list) and len(v) <= 128 and all(isinstance(t, dict) for t in v),
              "an array of at most 128 objects"),
    "tool_choice": (lambda v: isinstance(v, str | dict), "a string or an object"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),
    "top_k": (_integer(-1, 1_000_000), "an integer (-1: no limit)"),
    "min_p": (_number(0, 1), "a number from 0 to 1"),
    "repetition_penalty": (_number(0.01, 100), "a positive number"),
    "metadata": (lambda v: isinstance(v, dict) and len(v) <= 16
                 and all(len(k) <= 64 and isinstance(x, str) and len(x) <= 512 for k, x in v.items()),
                 "an object of at most 16 entries, each a string of at most 512 characters under a key of at "
                 "most 64"),
    "store": (lambda v: isinstance(v, bool), "a boolean"),
}
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
IMAGE_TYPES = ("image_url", "input_image")


def image_parts(messages: list) -> list[dict]:
    """Every image part of a (validated) chat request, in order."""
    found = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found.extend(part for part in content if isinstance(part, dict) and part.get("type") in IMAGE_TYPES)
    return found


def image_url_place(part: dict) -> tuple[dict | None, str]:
    """Where an image part's URL is read: the object holding it and its key there (the part
    itself, when the URL is the part's value; else the object under the part's key, at "url"),
    or None when there is no such object."""
    key = "image_url" if part.get("type") == "image_url" else "input_image"
    spec = part.get(key)
    if isinstance(spec, str | DecodedDataURL):
        return part, key
    return (spec, "url") if isinstance(spec, dict) else (None, key)


def image_detail(part: dict):
    """The `detail` an image part asks for (None: none), beside its URL."""
    holder, _ = image_url_place(part)
    return holder.get("detail") if holder is not None and holder is not part else None


def _validate_content(index: int, content) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestInvalid(f"messages[{index}].content must be a string or an array", param="messages")
    for n, part in enumerate(content):
        where = f"messages[{index}].content[{n}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestInvalid(f"{where} must be an object with a type", param="messages")
        kind = part["type"]
        if kind == "text":  # rebuilt below without extra keys
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise RequestInvalid(f"{where} must be {{'type': 'text', 'text': <string>}}", param="messages")
        elif kind not in IMAGE_TYPES:
            raise RequestInvalid(f"{where} has type {kind!r}; only text and image_url parts are accepted",
                                 param="messages", code="unsupported_content_type")


def validate_body(body) -> None:
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object")
    unknown = sorted(set(body) - REQUEST_FIELDS)
    if unknown:
        raise RequestInvalid(f"unrecognized request argument: {unknown[0]}", param=unknown[0],
                             code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestInvalid("you must provide a model parameter", param="model", code="missing_model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestInvalid("messages must be a non-empty array", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestInvalid(f"messages has {len(messages)} entries; at most {MAX_MESSAGES}", param="messages")
    parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > MAX_PARTS:  # counted before any is looked at
        raise RequestInvalid(f"the messages have {parts} content parts in all; at most {MAX_PARTS}", param="messages")
    for name, (valid, what) in PARAMETER_TYPES.items():
        if body.get(name) is not None and not valid(body[name]):
            raise RequestInvalid(f"{name} must be {what}", param=name, code="invalid_type")
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise RequestInvalid(f"messages[{index}] must be an object with a role "
                                 f"({', '.join(sorted(ROLES))})", param="messages")
        extra = sorted(set(message) - MESSAGE_FIELDS)
        if extra:
            raise RequestInvalid(f"messages[{index}] has an unrecognized field: {extra[0]}", param="messages")
        _validate_content(index, message.get("content"))
    n = body.get("n", 1)
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise RequestInvalid("only n=1 is supported", param="n")
    if body.get("stream") not in (None, True, False):
        raise RequestInvalid("stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise RequestInvalid("stream_options must be an object with include_usage", param="stream_options")
        if options.get("include_usage") not in (None, True, False):
            raise RequestInvalid("stream_options.include_usage must be a boolean",
                                 param="stream_options")
    for name in ("max_tokens", "max_completion_tokens"):
        limit = body.get(name)
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise RequestInvalid(f"{name} must be a positive integer", param=name)
    if body.get("ignore_eos") not in (None, True, False):
        raise RequestInvalid("ignore_eos must be a boolean", param="ignore_eos")
    least = body.get("min_tokens")
    if least is not None and (not isinstance(least, int) or isinstance(least, bool) or least < 0):
        raise RequestInvalid("min_tokens must be a non-negative integer", param="min_tokens")
    most = body.get("max_completion_tokens") or body.get("max_tokens")
    if least and most and least > most:
        raise RequestInvalid(f"min_tokens {least} exceeds max_tokens {most}", param="min_tokens")
