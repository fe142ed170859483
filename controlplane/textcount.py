"""Text token estimate shared by the gateway's admission and the simulator engine.

Real engines report exact prompt tokens; this estimate is what the gateway reserves
against quotas before forwarding, and what the simulator reports as its own count.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\w{1,4}|[^\w\s]")
MESSAGE_OVERHEAD = 4  # role marker, separators and end-of-turn per chat message
REPLY_PRIMER = 3  # the assistant header the chat template appends


def count_text_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def _pieces(messages: list[dict]):
    """A chat prompt in order, as (text positions, image part or None) pieces."""
    for message in messages:
        yield MESSAGE_OVERHEAD, None
        content = message.get("content")
        if isinstance(content, str):
            yield count_text_tokens(content), None
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "text":
                    yield count_text_tokens(str(part.get("text", ""))), None
                elif part.get("type") in ("image_url", "input_image"):
                    yield 0, part


def prompt_text_tokens(messages: list[dict]) -> int:
    """Text positions of a chat prompt, images excluded."""
    return REPLY_PRIMER + sum(tokens for tokens, _ in _pieces(messages))


def image_positions(messages: list[dict], image_tokens: list[int]) -> list[int]:
    """Where each image starts in the prompt, laid out as `prompt_text_tokens` counts it.

    `image_tokens` gives each image part's tokens in order. With the engine's reported
    cached prefix, this tells which images were served from the prefix cache.
    """
    positions, position = [], 0
    for tokens, image in _pieces(messages):
        if image is not None and len(positions) < len(image_tokens):
            positions.append(position)
            tokens = image_tokens[len(positions) - 1]
        position += tokens
    return positions
