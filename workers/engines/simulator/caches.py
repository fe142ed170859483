"""The simulator's caches, least-recently-used, and the block keys of a prompt.

- ImageCache: image digest -> image tokens, as vLLM keys its two image caches on a hash
  of the image: the processor cache, queried once for every image of every request as it
  is processed (its lookups are the vllm:mm_cache_* metrics), and the encoder cache, which
  lets the same image bytes seen again skip the vision encoder.
- PrefixCache: the keys of the full KV blocks prefills have computed, which vLLM keeps
  after a request ends and hands to a later prompt that starts with the same blocks. It
  holds at most the KV pool's number of blocks, as cached blocks live in that pool.
- block_keys: one key per full block of a prompt, chained like vLLM's block hashes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


class ImageCache:
    def __init__(self, items: int = 256):
        self.items = items
        self.entries: OrderedDict[str, int] = OrderedDict()

    def lookup(self, digest: str, tokens: int) -> bool:
        """True on a hit; a miss records the image, as its processing is about to run."""
        if digest in self.entries:
            self.entries.move_to_end(digest)
            return True
        self.entries[digest] = tokens
        while len(self.entries) > self.items:
            self.entries.popitem(last=False)
        return False


def block_keys(runs: list[tuple[str, int]], block_size: int, salt: str | None = None) -> list[str]:
    """A key for each full block of a prompt given as runs of (what, positions), in order.

    A block's key hashes the key before it and the runs it holds, each as (what, offset in
    the run, positions), so that it stands for the whole prefix up to its end, as vLLM's
    chained block hashes do (which also put image hashes into the blocks an image covers).
    The cache_salt seeds the chain: different salts never share a block.
    """
    keys, block, filled = [], [], 0
    parent = hashlib.blake2b(repr(salt).encode(), digest_size=16).hexdigest()
    for what, length in runs:
        offset = 0
        while offset < length:
            n = min(length - offset, block_size - filled)
            block.append((what, offset, n))
            offset, filled = offset + n, filled + n
            if filled == block_size:
                parent = hashlib.blake2b(repr((parent, block)).encode(), digest_size=16).hexdigest()
                keys.append(parent)
                block, filled = [], 0
    return keys


class PrefixCache:
    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.entries: OrderedDict[str, None] = OrderedDict()

    def lookup(self, keys: list[str]) -> int:
        """How many of a prompt's block keys are cached, counting from its first block."""
        hit = 0
        while hit < len(keys) and keys[hit] in self.entries:
            hit += 1
        self._touch(keys[:hit])
        return hit

    def insert(self, keys: list[str]) -> None:
        self._touch(keys)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def _touch(self, keys: list[str]) -> None:
        # Last block first, so that a prompt's first blocks are evicted last: a block is no
        # use without the ones before it (vLLM frees a request's blocks in reverse for this).
        for key in reversed(keys):
            self.entries[key] = None
            self.entries.move_to_end(key)
