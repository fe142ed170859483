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


def prompt_text_tokens(messages: list[dict]) -> int:
    """Text positions of a chat prompt, images excluded."""
    total = REPLY_PRIMER
    for message in messages:
        total += MESSAGE_OVERHEAD
        content = message.get("content")
        if isinstance(content, str):
            total += count_text_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    total += count_text_tokens(str(part.get("text", "")))
    return total


def image_positions(messages: list[dict], image_tokens: list[int]) -> list[int]:
    """Where each image starts in the prompt, laid out as `prompt_text_tokens` counts it.

    `image_tokens` gives each image part's tokens in order. With the engine's reported
    cached prefix, this tells which images were served from the prefix cache.
    """
    positions, position, index = [], 0, 0
    for message in messages:
        position += MESSAGE_OVERHEAD
        content = message.get("content")
        if isinstance(content, str):
            position += count_text_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "text":
                    position += count_text_tokens(str(part.get("text", "")))
                elif part.get("type") in ("image_url", "input_image") and index < len(image_tokens):
                    positions.append(position)
                    position += image_tokens[index]
                    index += 1
    return positions
