"""Reading a tenant's request body: JSON, its large images' base64 left out, its shape bounded.

A 12 MP photo's body is 3 MB, nearly all of it one string: the base64 of the photo. Read as
JSON, that string is scanned for its end and its escapes, checked as UTF-8 and copied into a
Python string (about 0.8 ms), only for its base64 to be decoded from it next. Instead, each
large base64 data URL is found in the bytes and decoded there (base64 checks every character
it reads: no quote, escape, control or non-ASCII character passes), and the JSON is read with a
stand-in of its own in its place; the stand-in's string, found where the request's image URL is
read from, is replaced by the decoded URL (`DecodedDataURL`).

The result is what reading the whole body gives, with each such URL decoded: the bytes between
the stand-in's quotes hold no quote or escape, whether or not they are a string of their own,
so the body with the stand-ins is valid JSON exactly when the body is, and a stand-in read back
whole, where an image's URL is, was the whole of that string. Whatever does not hold to that
(a stand-in read anywhere else, a URL with an escape in it such as `\\/`, a body that is not
valid JSON) has the whole body read as it came, for the same result or the same error.

What is read is bounded before it is read: a JSON parser's time grows with the objects, keys
and values it makes, not with the bytes (60 MB of empty arrays took 7 s; 100 KB of numbers
near 1e300, msgspec's slow path, 1 s). So the JSON left around the images is refused when it
holds more of them than a chat request can use, counted in its bytes (strings' content
included: a string's commas count too) by C loops at about 1.5 GB/s, before it is parsed;
and orjson parses it, whose time per value has no such slow path.
"""

from __future__ import annotations

import re
import secrets

import orjson

from controlplane.gateway.validation import image_parts, image_url_place
from controlplane.imaging.policy import DecodedDataURL, decoded_data_url

_LARGE_URL = 64 * 1024  # characters of a data URL worth decoding where it lies
# Bodies from this size on are looked through for large images.
LARGE_BODY = _LARGE_URL
_LOOKS = 64  # places a body may have a data URL in before it is read whole instead
_HEAD = re.compile(rb'data:[^"\\,]{0,240},')  # its media type and parameters, up to the comma

# What the JSON around a request's images may hold: objects and arrays ({ and [), keys (:) and
# values (,). A chat request at every limit of prepare's (2,048 messages, 4,096 parts, 128
# tools) holds a tenth of them; a long-context prompt's prose, a comma every 60 bytes or so.
# orjson reads the worst body within them in about 15 ms.
MAX_CONTAINERS, MAX_KEYS, MAX_VALUES = 32_768, 65_536, 131_072
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b"{[:,")
_SLICE = 1 << 20  # counted a megabyte at a time, to stop at the first that passes a limit


class TooComplex(ValueError):
    """A body whose JSON holds more objects, keys or values than a request may."""


def read_body(raw: bytes) -> object:
    """The JSON `raw`, read; TooComplex before it is read if its shape is past the limits, else
    ValueError as orjson raises for the whole."""
    body = _read_with_stand_ins(raw) if len(raw) >= LARGE_BODY else None
    return _read_json(raw) if body is None else body


def _read_json(raw: bytes) -> object:
    _check_shape(raw)
    return orjson.loads(raw)


class ShapeCount:
    """The objects, keys and values counted in a body's bytes as they are fed (a piece as it
    arrives, or the whole a megabyte at a time): TooComplex once one passes its limit."""

    def __init__(self):
        self.containers = self.keys = self.values = 0

    def feed(self, data) -> None:
        for start in range(0, len(data), _SLICE):
            structure = data[start:start + _SLICE].translate(None, _NOT_STRUCTURE)
            self.containers += structure.count(b"{") + structure.count(b"[")
            self.keys += structure.count(b":")
            self.values += structure.count(b",")
            for count, limit, what in ((self.containers, MAX_CONTAINERS, "objects and arrays"),
                                       (self.keys, MAX_KEYS, "keys"), (self.values, MAX_VALUES, "values")):
                if count > limit:
                    raise TooComplex(f"the request body holds more than {limit:,} JSON {what}")


def _check_shape(raw: bytes) -> None:
    ShapeCount().feed(raw)


def _read_with_stand_ins(raw: bytes) -> object | None:
    """`raw` read with its large data URLs decoded, or None where it must be read whole (what
    this made is let go of first: a body of megabytes is not held twice over)."""
    found = _large_data_urls(raw)
    if not found:
        return None
    mark = secrets.token_hex(16)  # unguessable: no tenant can write it elsewhere in the body
    view, pieces, stand_ins, end = memoryview(raw), [], {}, 0
    for number, (start, stop, url) in enumerate(found):
        stand_in = f"{mark}{number}"
        pieces += (view[end:start], stand_in.encode())
        stand_ins[stand_in], end = url, stop
    pieces.append(view[end:])
    try:
        body = _read_json(b"".join(pieces))
    except TooComplex:
        raise
    except ValueError:
        return None  # read whole, for its own error
    return body if _put_back(body, stand_ins) == len(found) else None


def _large_data_urls(raw: bytes) -> list[tuple[int, int, DecodedDataURL]]:
    """Where each large base64 data URL lies in `raw` (from after its opening quote to its
    closing one), decoded; none once `_LOOKS` places have been looked at (a body of countless
    `"data:` is read whole, in the parser's time, not looked through a step at a time)."""
    found, at = [], raw.find(b'"data:')
    for _ in range(_LOOKS):
        if at < 0:
            return found
        head = _HEAD.match(raw, at + 1)
        stop = raw.find(b'"', head.end()) if head is not None else -1
        url = None
        if stop - (at + 1) >= _LARGE_URL:
            url = decoded_data_url(memoryview(raw)[at + 1:stop])
        if url is not None:
            found.append((at + 1, stop, url))
        at = raw.find(b'"data:', stop if url is not None else at + 1)
    return found if at < 0 else []


def _put_back(body: object, stand_ins: dict[str, DecodedDataURL]) -> int:
    """Each stand-in read where the gateway reads an image's URL (prepare's `image_url_place`)
    replaced by its URL: how many were."""
    replaced = 0
    messages = body.get("messages") if isinstance(body, dict) else None
    for part in image_parts(messages) if isinstance(messages, list) else ():
        holder, field = image_url_place(part)
        url = None if holder is None else holder.get(field)
        if isinstance(url, str) and url in stand_ins:
            holder[field] = stand_ins.pop(url)
            replaced += 1
    return replaced
