"""A request as the engine loop sees it, and one step's plan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

BLOCK_SIZE = 16  # tokens per KV block: vLLM's default on a GPU (its CPU build uses 128)


@dataclass
class ImageSpan:
    start: int  # prompt position of its first token
    tokens: int
    digest: str
    encoded: bool = False


@dataclass(eq=False)
class Sequence:
    prompt_tokens: int
    reply: list[str]  # the tokens it emits, in order
    finish_reason: str  # once all of `reply` is out: "stop" or "length"
    priority: int = 0
    images: list[ImageSpan] = field(default_factory=list)
    block_keys: list[str] = field(default_factory=list)  # one per full block of the prompt
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "new"  # waiting, running, finished
    arrival: int = 0
    arrived_at: float = 0.0
    output: int = 0
    num_computed: int = 0
    blocks: int = 0
    aborted: bool = False
    prefix_hit: int | None = None  # tokens, at first admission
    created_cache_tokens: int = 0  # prompt tokens it writes into new cache blocks
    encoder_hit_tokens: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output

    @property
    def cached_tokens(self) -> int:
        # As vLLM reports it: prompt tokens served from the prefix cache. Encoder-cache hits
        # save vision encoding, not prefill, and show only in the vllm:mm_cache_* metrics.
        return self.prefix_hit or 0


@dataclass
class Step:
    decodes: list[Sequence]
    chunks: list[tuple[Sequence, int]]
    duration: float


def blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
