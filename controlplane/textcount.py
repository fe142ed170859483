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
