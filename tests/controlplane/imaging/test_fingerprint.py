"""Fingerprints identify a picture across re-encodings, and only that picture."""

from __future__ import annotations

import io
import itertools
import random

import pytest
from PIL import Image

from controlplane.imaging.fingerprint import (
    FingerprintIndex,
    narrowed,
    narrowed_bits,
    perceptual_bits,
)
from controlplane.imaging.policy import Policy, normalise
from tests.images import picture

ENCODINGS = [("PNG", {}), ("BMP", {}), ("JPEG", {"quality": 95}), ("JPEG", {"quality": 85}),
             ("JPEG", {"quality": 70}), ("WEBP", {"quality": 90}), ("WEBP", {"quality": 75})]


def encoded(image: Image.Image, fmt: str, options: dict) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


CORPUS = [picture(seed) for seed in range(16)]


@pytest.mark.parametrize("seed", range(len(CORPUS)))
def test_re_encodings_of_a_picture_share_one_fingerprint_through_the_index(seed):
    index = FingerprintIndex()
    prints = {normalise(encoded(CORPUS[seed], fmt, options), Policy(), index=index).fingerprint
              for fmt, options in ENCODINGS}
    assert len(prints) == 1


def test_different_pictures_never_share_a_fingerprint():
    index = FingerprintIndex()
    prints = [normalise(encoded(image, "PNG", {}), Policy(), index=index).fingerprint for image in CORPUS]
    assert len(set(prints)) == len(CORPUS)


def test_the_bits_of_re_encodings_stay_close_and_of_different_pictures_far_apart():
    within = [bin(perceptual_bits(CORPUS[s]) ^ perceptual_bits(Image.open(io.BytesIO(encoded(CORPUS[s], f, o))))).count("1")
              for s in range(len(CORPUS)) for f, o in ENCODINGS]
    between = [bin(perceptual_bits(a) ^ perceptual_bits(b)).count("1") for a, b in itertools.combinations(CORPUS, 2)]
    assert max(within) <= 6 < 12 <= min(between)


def test_a_lossless_re_encoding_has_the_same_fingerprint_even_without_an_index():
    png = normalise(encoded(CORPUS[0], "PNG", {}), Policy()).fingerprint
    bmp = normalise(encoded(CORPUS[0], "BMP", {}), Policy()).fingerprint
    assert png == bmp


@pytest.mark.parametrize("size", [(1156, 867), (867, 1156), (300, 2000), (2000, 120), (20, 700), (700, 20)])
def test_the_thumbnail_made_a_band_of_rows_at_a_time_has_the_bits_of_the_whole(size):
    # How a large photo's fingerprint is made while it is decoded: the first pass a band at a
    # time, the second once its rows are all in. Tall pictures too, which Pillow's one-call
    # resize would take columns first.
    rng = random.Random(size[0] * size[1])
    grey = picture(size[0] % 7).resize(size).convert("L")
    cuts = sorted({0, size[1], *(rng.randrange(size[1]) for _ in range(6))})
    rows = b"".join(narrowed(grey.crop((0, top, size[0], bottom))) for top, bottom in itertools.pairwise(cuts))
    assert rows == narrowed(grey)
    assert narrowed_bits(rows, size[1]) == perceptual_bits(grey) == perceptual_bits(grey.convert("RGB"))


def test_the_same_picture_at_another_size_is_another_fingerprint():
    index = FingerprintIndex()
    big = normalise(encoded(CORPUS[0], "PNG", {}), Policy(), index=index).fingerprint
    small = normalise(encoded(CORPUS[0].resize((320, 240)), "PNG", {}), Policy(), index=index).fingerprint
    assert big != small


def test_the_index_forgets_the_least_recently_seen_beyond_its_bound():
    index = FingerprintIndex(max_items=4)
    first = index.canonical(CORPUS[0])
    for image in CORPUS[1:6]:
        index.canonical(image)
    assert len(index) == 4
    assert index.canonical(CORPUS[0]) == first  # recomputed, and deterministic


def test_a_tenant_never_gets_the_fingerprint_of_another_tenants_re_encoding():
    """Otherwise a re-encoded copy answered with a fingerprint other than its own reveals that
    somebody else sent the picture."""
    index = FingerprintIndex()
    jpeg, png = (encoded(CORPUS[2], fmt, options) for fmt, options in (ENCODINGS[3], ("PNG", {})))
    theirs = normalise(jpeg, Policy(), index=index.scoped("alice")).fingerprint
    mine = normalise(png, Policy(), index=index.scoped("bob")).fingerprint
    assert mine == normalise(png, Policy()).fingerprint != theirs  # its own, as if nobody had sent it
    assert normalise(png, Policy(), index=index.scoped("alice")).fingerprint == theirs  # alice's copies: one
