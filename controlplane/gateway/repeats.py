"""Pictures this gateway process has prepared, for the requests that send them again.

A chat resends every earlier image on each turn, so a tenant's photo reaches the gateway again
and again. What the policy made of it the first time (its images, their fingerprints, the keys
engines are chosen by) is kept, and a picture sent again is not decoded, resampled, encoded or
checked again. Kept:

- per tenant: how long a picture took must not tell one tenant that another sent it;
- per policy and detail: an operator's change to a tier's policy, or a detail of `low`, make
  other images of the same bytes;
- only once every check has passed: an image sent as it came is kept when its check beside
  the engine passes (a picture that fails is refused again each time it is sent);
- by the XXH3-128 of the bytes (0.24 ms for a 12 MP photo, where a SHA-256 takes 2): a
  collision, were one ever crafted, could only be among one tenant's own pictures, and what
  is sent and billed is then what the policy made of the picture kept, checked as any other;
- in memory, each process its own (replicas behind a load balancer each keep theirs), the
  least recently sent forgotten past GATEWAY_REPEATS_MB of images.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import xxhash

from controlplane.imaging.policy import NormalisedImage

_ENTRY = 512  # bytes an entry costs beyond its images' data, roughly


@dataclass(frozen=True)
class Key:
    """Which picture, as whose, under what policy, at what pixel cap (its detail's)."""

    scope: str
    policy: Hashable
    cap: int
    size: int
    digest: bytes

    @classmethod
    def of(cls, data: bytes, *, scope: str, policy: Hashable, cap: int) -> Key:
        return cls(scope, policy, cap, len(data), xxhash.xxh3_128_digest(data))


def digest(data: bytes) -> str:
    """The key engines are chosen by for an image sent to them (32 hex characters)."""
    return xxhash.xxh3_128_hexdigest(data)


Prepared = tuple[tuple[NormalisedImage, str], ...]  # its images, each with its `digest`


class Repeats:
    """What pictures became, least recently sent forgotten first past `max_bytes` of images."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[Key, Prepared] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # pictures are prepared on several threads

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: Key) -> Prepared | None:
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
            return found

    def put(self, key: Key, images: Prepared) -> None:
        if any(image.check is not None for image, _ in images):
            raise ValueError("an image is kept only once its check has passed")
        cost = _cost(images)
        if cost > self.max_bytes:
            return
        with self._lock:
            if (old := self._kept.pop(key, None)) is not None:
                self._bytes -= _cost(old)
            self._kept[key] = images
            self._bytes += cost
            while self._bytes > self.max_bytes:
                _, gone = self._kept.popitem(last=False)
                self._bytes -= _cost(gone)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._bytes = 0


def _cost(images: Prepared) -> int:
    return sum(len(image.data) for image, _ in images) + _ENTRY
