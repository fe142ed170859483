"""The bad-input corpus: each input gives a typed error or a correct image, within bounded
time and memory. Every case runs in a child process limited to 1 GiB of address space."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.imaging_corpus import corpus
from tests.system.harness import ROOT

CHILD = r"""
import io, json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from PIL import Image
from controlplane.imaging.errors import ImageError
from controlplane.imaging.policy import Policy, normalise_tiles
data = sys.stdin.buffer.read()
started = time.perf_counter()
try:
    tiles = normalise_tiles(data, Policy())
    image = Image.open(io.BytesIO(tiles[0].data)).convert("RGB")
    result = {"ok": [tiles[0].width, tiles[0].height], "top_left": image.getpixel((5, 5)),
              "right": image.getpixel((image.width - 5, image.height // 2)), "mode": image.mode}
except ImageError as exc:
    result = {"error": exc.code, "message": str(exc)}
result["seconds"] = time.perf_counter() - started
print(json.dumps(result))
"""

CASES = corpus()


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_bad_input_gives_a_typed_error_or_a_correct_image(name):
    data, expected = CASES[name]
    child = subprocess.run([sys.executable, "-c", CHILD], input=data, capture_output=True,
                           cwd=ROOT, timeout=60)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    result = json.loads(child.stdout)
    assert result["seconds"] < 5
    if isinstance(expected, str):
        assert result.get("error") == expected, result
        assert result["message"]
        return
    assert result.get("ok") == [expected[1], expected[2]], result
    if name.startswith("exif-orientation"):
        assert result["top_left"][0] > 150 and result["top_left"][2] < 100  # red stays top left
    if name == "transparent-png":
        assert result["right"] == [255, 255, 255] or min(result["right"]) > 245  # white, not black
    if name == "cmyk-jpeg":
        assert result["top_left"][0] < 60 and result["top_left"][1] > 200  # cyan, as printed
