"""A chat prompt laid out as the model will see it: the model's own chat template rendered
and tokenized with its own tokenizer (the fast `tokenizers` library), each image's
placeholder expanded to its tokens. Pure Python: no Django, no Celery.

It gives the exact prompt length the engine will report (so text is reserved against quotas
exactly) and the position where each image starts (so the engine's cached prefix says how
much of each image came from the cache). Where a tier has no tokenizer, the estimate in
`controlplane.textcount` stands in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The token a Qwen-VL chat template writes once per image, between <|vision_start|> and
# <|vision_end|>, which the processor expands to one token per vision feature.
IMAGE_PLACEHOLDERS = ("<|image_pad|>",)


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    prompt_tokens: int  # what the engine will report as prompt_tokens
    text_tokens: int  # prompt_tokens less the images' tokens
    image_positions: tuple[int, ...]  # where each image's tokens start


def _raise(message):
    raise TemplateError(message)


@lru_cache(maxsize=32)
def _template(source: str) -> jinja2.Template:
    # The environment chat templates are written for (Hugging Face's): sandboxed, blocks
    # trimmed, loop controls, a tojson filter and raise_exception.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = _raise
    return environment.from_string(source)


def _conversation(messages: list[dict]) -> list[dict]:
    """OpenAI messages in the form vLLM hands the template: images as {"type": "image"}."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                elif part.get("type") in ("image_url", "input_image"):
                    parts.append({"type": "image"})
            content = parts
        out.append({**message, "content": content})
    return out


class ChatTokenizer:
    """A model's tokenizer and chat template, as the engine applies them."""

    def __init__(self, tokenizer_json: str, chat_template: str, *, special: dict | None = None):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.chat_template = chat_template
        self.special = special or {}  # bos_token, eos_token as the template may use them
        ids = [self.tokenizer.token_to_id(token) for token in IMAGE_PLACEHOLDERS]
        self.placeholder_ids = frozenset(i for i in ids if i is not None)
        if not self.placeholder_ids:
            raise TemplateError("the tokenizer has no image placeholder token")

    def render(self, messages: list[dict]) -> str:
        try:
            return _template(self.chat_template).render(
                messages=_conversation(messages), add_generation_prompt=True, **self.special)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed: {exc}") from None

    def layout(self, messages: list[dict], image_tokens: list[int], *, markers: int) -> Layout:
        """The prompt with each image taking `image_tokens[i]` positions, of which `markers`
        are tokens the template writes around its placeholder (they start the image)."""
        ids = self.tokenizer.encode(self.render(messages), add_special_tokens=False).ids
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
