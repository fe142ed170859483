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
- in memory, each process its own, the least recently sent forgotten past GATEWAY_REPEATS_MB
  of images;
- and, with GATEWAY_SHARED_REPEATS_URL, in a Redis every replica reads (`Shared`): replicas
  behind a load balancer that spreads a chat's turns over them find what another made of the
  picture. Each replica still keeps its own first; the shared one is asked only when it has
  none, and anything wrong with it (down, slow, an entry that does not read back whole) is a
  picture not found there, never a request refused.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import orjson
import PIL
import redis
import simplejpeg
import xxhash

import controlplane.imaging
from controlplane.gateway.counters import Counters
from controlplane.imaging.decode import pixel_content
from controlplane.imaging.policy import NormalisedImage
from controlplane.threads import Threads

log = logging.getLogger(__name__)

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
        """The key of the picture `data`: of what decides its pixels (imaging.decode.pixel_content),
        so that a copy that differs in metadata alone is the same picture."""
        content = pixel_content(data)
        if len(content) == 1:
            return cls(scope, policy, cap, len(data), xxhash.xxh3_128_digest(data))
        digest = xxhash.xxh3_128()
        for part in content:
            digest.update(part)
        return cls(scope, policy, cap, sum(len(part) for part in content), digest.digest())


def digest(data: bytes) -> str:
    """The key engines are chosen by for an image sent to them (32 hex characters)."""
    return xxhash.xxh3_128_hexdigest(data)


Picture = tuple[tuple[NormalisedImage, str], ...]  # its images, each with its `digest`


class Repeats:
    """What pictures became, least recently sent forgotten first past `max_bytes` of images;
    behind them, with `shared`, what every replica made of them."""

    def __init__(self, max_bytes: int, shared: Shared | None = None):
        self.max_bytes, self.shared = max_bytes, shared
        self._kept: OrderedDict[Key, Picture] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # pictures are prepared on several threads

    @property
    def bytes(self) -> int:
        return self._bytes

    def kept_here(self, key: Key) -> Picture | None:
        """What the picture became in this process, if it is kept here (no trip to the shared
        store: safe on the event loop)."""
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
            return found

    def get(self, key: Key) -> Picture | None:
        """What the picture became, kept here or, failing that, in the shared store (blocking)."""
        if (found := self.kept_here(key)) is None and self._sharing(key) \
                and (found := self.shared.get(key)) is not None:
            self._keep(key, found)
        return found

    def put(self, key: Key, images: Picture) -> None:
        if any(image.check is not None for image, _ in images):
            raise ValueError("an image is kept only once its check has passed")
        self._keep(key, images)
        if self._sharing(key):
            self.shared.put(key, images)

    def _sharing(self, key: Key) -> bool:
        return self.shared is not None and key.size >= self.shared.MIN_BYTES

    def _keep(self, key: Key, images: Picture) -> None:
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


def _cost(images: Picture) -> int:
    return sum(len(image.data) for image, _ in images) + _ENTRY


class Shared:
    """What pictures became, in a Redis every gateway replica reads and writes.

    An entry is the images' bytes and what is known of them, for `ttl_s` after it was last
    asked for or written (a chat's turns come minutes apart). Its name carries the deployment's
    prefix, the code that made it (`maker`: entries an older release made are another
    picture's), the tenant, detail cap and size in the clear (two tenants' pictures never share
    a name, whatever the hash), and a hash of the policy and the bytes' digest; its head
    carries the tenant, cap and size again, compared on reading. Meant for a Redis of its own
    (6.2 or later) that evicts what it must (`maxmemory` with `allkeys-lru`), not the
    ledger's: a cache must never take the memory the usage in flight needs.

    Asked on the thread preparing the picture, and bounded: a reply not in READ_TIMEOUT_S, or
    anything wrong with it, is a picture not found, and after a failure the store is not asked
    for PAUSE_S, so a store that is down costs a request nothing but the first timeout.
    Written on a thread of its own (a few megabytes may take longer than a read: WRITE_TIMEOUT_S),
    at most MAX_WRITING entries waiting (more are dropped), none while writes rest after a
    failure: the answer never waits on it. An entry is taken only if it reads back whole and
    as written: its fields of their types, its images' bytes matching their digests.

    Only pictures of MIN_BYTES or more are shared. Preparing a picture costs about its bytes
    (their entropy decoding): a 1 MP photo's 260 KB take 2-4 ms, which a round trip to the
    store and a write of the entry beside the answer would take back (1 ms more a new 1 MP
    picture in bench/gateway), where a 12 MP photo's 2-3 MB take 25-35 ms."""

    MIN_BYTES = 512 * 1024
    PAUSE_S = 5.0
    MAX_WRITING = 16
    READ_TIMEOUT_S = 0.1
    WRITE_TIMEOUT_S = 2.0

    def __init__(self, url: str, *, prefix: str, ttl_s: int, counters: Counters):
        self.prefix, self.ttl_s, self.counters = f"{prefix}:repeats:{maker()}:", ttl_s, counters
        self._reads, self._writes = (redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
            url, max_connections=connections, timeout=timeout, socket_timeout=timeout,
            socket_connect_timeout=timeout)) for connections, timeout in
            ((64, self.READ_TIMEOUT_S), (1, self.WRITE_TIMEOUT_S)))
        self._writer = Threads("shared-pictures", 1)  # this process's own, as a forked child needs
        self._writing = 0
        self._lock = threading.Lock()
        self._reads_rest_until = self._writes_rest_until = 0.0

    @classmethod
    def from_settings(cls, counters: Counters) -> Shared | None:
        # Django's settings, and the Redis clients that read them, in the gateway's process
        # only: request preparation imports this module where Django is not set up.
        from django.conf import settings

        from controlplane.redis_clients import key_prefix

        url = settings.GATEWAY_SHARED_REPEATS_URL
        return cls(url, prefix=key_prefix(), ttl_s=settings.GATEWAY_SHARED_REPEATS_TTL_S,
                   counters=counters) if url else None

    def name(self, key: Key) -> str:
        picture = xxhash.xxh3_128_hexdigest(repr(key.policy).encode() + b"\0" + key.digest)
        return f"{self.prefix}{key.scope}:{key.cap}:{key.size}:{picture}"

    def get(self, key: Key) -> Picture | None:
        if time.monotonic() < self._reads_rest_until:
            return None
        try:
            blob = self._reads.getex(self.name(key), ex=self.ttl_s)  # a picture in use stays
            found = None if blob is None else unpacked(blob, key)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the picture is prepared here
            self._failed("read", exc)
            return None
        self.counters.shared_picture("hit" if found is not None else "miss")
        return found

    def put(self, key: Key, images: Picture) -> None:
        with self._lock:
            dropped = self._writing >= self.MAX_WRITING or time.monotonic() < self._writes_rest_until
            self._writing += not dropped
        if dropped:
            self.counters.shared_picture("dropped")
            return
        self._writer().submit(self._write, key, images)

    def _write(self, key: Key, images: Picture) -> None:
        """On the writer's thread: the entry packed (a copy of megabytes) off the request's."""
        try:
            if time.monotonic() < self._writes_rest_until:  # a write before this one failed
                self.counters.shared_picture("dropped")
            else:
                self._writes.set(self.name(key), packed(images, key), ex=self.ttl_s)
        except Exception as exc:  # noqa: BLE001 - a thread of its own: nothing above it to tell
            self._failed("write", exc)
        finally:
            with self._lock:
                self._writing -= 1

    def _failed(self, doing: str, exc: Exception) -> None:
        self.counters.shared_picture("failed")
        attribute = "_reads_rest_until" if doing == "read" else "_writes_rest_until"
        with self._lock:
            resting = time.monotonic() < getattr(self, attribute)
            setattr(self, attribute, time.monotonic() + self.PAUSE_S)
        if not resting:
            log.warning("the shared store of pictures failed to %s (%s: %s); not asked to for %ss", doing,
                        type(exc).__name__, exc, self.PAUSE_S)


@functools.cache
def maker() -> str:
    """Which code makes what a picture becomes: the image library's own source and the
    decoders' versions, hashed. Entries made by another release are never taken for this
    one's, though no one remembered to say what changed."""
    package = Path(controlplane.imaging.__file__).parent
    made = xxhash.xxh3_64(f"{PIL.__version__} {simplejpeg.__version__}".encode())
    for path in sorted([*package.rglob("*.py"), *package.glob("*.c")]):
        made.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return made.hexdigest()


_TEXT = ("source_format", "mime", "fingerprint")
_NUMBERS = ("source_width", "source_height", "width", "height", "tile", "tiles")


def packed(images: Picture, key: Key) -> bytes:
    """Images as one entry: the length of a JSON head, the head (whose picture, and each
    image's fields, digest and length), then each image's bytes."""
    head = orjson.dumps({"scope": key.scope, "cap": key.cap, "size": key.size, "images": [
        {**{name: getattr(image, name) for name in (*_TEXT, *_NUMBERS)}, "digest": image_key, "length": len(image.data)}
        for image, image_key in images]})
    return len(head).to_bytes(4, "big") + head + b"".join(image.data for image, _ in images)


def unpacked(blob: bytes, key: Key) -> Picture | None:
    """The images of `key`'s entry, or None when it does not read back whole and as written:
    a head that does not parse or names another picture, fields not of their types, lengths
    that do not add up, bytes that do not match their digest."""
    try:
        size = int.from_bytes(blob[:4], "big")
        head = orjson.loads(blob[4:4 + size])
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None
    if not isinstance(head, dict) or (head.get("scope"), head.get("cap"), head.get("size")) != (
            key.scope, key.cap, key.size) or not isinstance(head.get("images"), list):
        return None
    images, at, count = [], 4 + size, len(head["images"])
    for position, fields in enumerate(head["images"]):
        if not isinstance(fields, dict) or not all(isinstance(fields.get(name), str) for name in (*_TEXT, "digest")) \
                or not all(_count(fields.get(name)) for name in (*_NUMBERS, "length")):
            return None
        if fields["tile"] != position or fields["tiles"] != count or not fields["width"] or not fields["height"]:
            return None
        data = blob[at:at + fields["length"]]
        at += fields["length"]
        if len(data) != fields["length"] or digest(data) != fields["digest"]:
            return None
        images.append((NormalisedImage(data=data, **{name: fields[name] for name in (*_TEXT, *_NUMBERS)}),
                       fields["digest"]))
    return tuple(images) if images and at == len(blob) else None


def _count(value) -> bool:
    return type(value) is int and value >= 0
