"""The simulator's two caches, both least-recently-used.

- EncoderCache: image digest -> image tokens. The same image bytes seen again skip the
  vision encoder (vLLM keys its encoder and processor caches on a hash of the image).
- PrefixCache: hash of a prompt prefix (cache_salt, then whole chat messages, images by
  digest) -> the prompt tokens that prefix covers. It stands for the KV blocks vLLM keeps
  after a request ends and reuses for a later prompt with the same start. Its size is
  bounded in tokens by the KV capacity, as the cached blocks live in the same KV pool.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    def __init__(self, items: int = 256):
        self.items = items
        self.entries: OrderedDict[str, int] = OrderedDict()

    def lookup(self, digest: str, tokens: int) -> bool:
        """True on a hit; a miss records the image, as its encoding is about to run."""
        if digest in self.entries:
            self.entries.move_to_end(digest)
            return True
        self.entries[digest] = tokens
        while len(self.entries) > self.items:
            self.entries.popitem(last=False)
        return False


class PrefixCache:
    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.tokens = 0

    def lookup(self, prefixes: list[tuple[str, int]]) -> int:
        """Tokens of the longest cached prefix among `prefixes` (shortest first), or 0."""
        for key, tokens in reversed(prefixes):
            if key in self.entries:
                self.entries.move_to_end(key)
                return tokens
        return 0

    def insert(self, prefixes: list[tuple[str, int]]) -> None:
        for key, tokens in prefixes:
            if key in self.entries:
                self.entries.move_to_end(key)
                continue
            self.entries[key] = tokens
            self.tokens += tokens
        while self.tokens > self.capacity and self.entries:
            self.tokens -= self.entries.popitem(last=False)[1]
