"""What a benchmark sends: a deterministic request mix of text and images.

Pure Python (Pillow for the synthetic images): no Django, no Celery. Request `n` of a
workload is the same for the same seed, so two runs of one profile send the same traffic.
"""

from __future__ import annotations

import base64
import functools
import io
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

TEXT, IMAGE, LARGE_IMAGE = "text", "image", "large_image"
CLASSES = (TEXT, IMAGE, LARGE_IMAGE)
CLASS_NAMES = {TEXT: "text", IMAGE: "image", LARGE_IMAGE: "large image"}

# Each synthetic image size comes in this many pixel variants. Engines cache encoded images
# by content, so a benchmark must not send one picture over and over; a pool this size
# misses a 256-entry encoder cache often enough without encoding a fresh JPEG per request.
VARIANTS = 64
_WORDS = ("data", "show", "what", "line", "note", "each", "item", "list", "word", "page",
          "form", "text", "plot", "axis", "year", "cost", "sign", "road", "tree", "blue")


@dataclass(frozen=True)
class Bucket:
    width: int
    height: int
    weight: float = 1.0


@dataclass(frozen=True)
class UploadedImage:
    data: bytes
    width: int
    height: int
    content_type: str = "image/jpeg"


@dataclass(frozen=True)
class Mix:
    text_share: float = 0.5  # share of requests without an image
    images_min: int = 1
    images_max: int = 1
    buckets: tuple[Bucket, ...] = (Bucket(1024, 768),)
    uploads: tuple[UploadedImage, ...] = ()  # used instead of the buckets when present
    prompt_tokens: tuple[int, int] = (32, 128)  # uniform, inclusive
    output_tokens: tuple[int, int] = (32, 64)


@dataclass
class RequestSpec:
    index: int
    klass: str
    body: dict  # an OpenAI chat completion body, without the model
    images: int = 0
    image_pixels: int = 0
    image_tokens: int = 0  # estimated: what the tier's policy and token formula give
    sizes: list[tuple[int, int]] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # e.g. the evaluation item a request asks about


def buckets_from_json(value) -> tuple[Bucket, ...]:
    return tuple(Bucket(int(b["width"]), int(b["height"]), float(b.get("weight", 1))) for b in value or ())


@functools.lru_cache(maxsize=4 * VARIANTS)
def synthetic_jpeg(width: int, height: int, variant: int) -> bytes:
    """A photo-like JPEG: a gradient with a few shapes placed by `variant`."""
    rng = random.Random(width * 7919 + height * 104729 + variant)
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = rng.randrange(width), rng.randrange(height)
        size = max(4, min(width, height) // rng.randint(4, 12))
        draw.rectangle((x, y, x + size, y + size), fill=(rng.randrange(256), rng.randrange(256),
                                                         rng.randrange(256)))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=85)
    return buffer.getvalue()


def data_url(data: bytes, content_type: str) -> str:
    return f"data:{content_type};base64," + base64.b64encode(data).decode()


def prompt_text(rng: random.Random, tokens: int, index: int) -> str:
    # Short words count as one token each; the request number up front keeps prompts apart
    # so that a prefix cache does not turn a benchmark into a cache test.
    head = f"Request {index}."
    return " ".join([head, *(rng.choice(_WORDS) for _ in range(max(0, tokens - 4)))])


class Workload:
    def __init__(self, mix: Mix, *, seed: int = 0, estimate_tokens: Callable[[int, int], int] | None = None,
                 large_threshold: int | None = None):
        if not 0 <= mix.text_share <= 1:
            raise ValueError("text_share must lie between 0 and 1")
        if mix.text_share < 1 and not (mix.buckets or mix.uploads):
            raise ValueError("image requests need image sizes or uploaded images")
        if not 0 < mix.images_min <= mix.images_max:
            raise ValueError("images per request: 1 <= min <= max")
        self.mix, self.seed = mix, seed
        self.estimate_tokens = estimate_tokens or (lambda w, h: 0)
        self.large_threshold = large_threshold

    def spec(self, index: int) -> RequestSpec:
        mix = self.mix
        rng = random.Random(self.seed * 1_000_003 + index)
        with_images = rng.random() >= mix.text_share
        text = prompt_text(rng, rng.randint(*mix.prompt_tokens), index)
        max_tokens = rng.randint(*mix.output_tokens)
        content: list[dict] = [{"type": "text", "text": text}]
        spec = RequestSpec(index=index, klass=TEXT, body={})
        if with_images:
            for _ in range(rng.randint(mix.images_min, mix.images_max)):
                url, width, height = self._image(rng)
                content.append({"type": "image_url", "image_url": {"url": url}})
                spec.sizes.append((width, height))
                spec.image_pixels += width * height
                spec.image_tokens += self.estimate_tokens(width, height)
            spec.images = len(spec.sizes)
            large = self.large_threshold is not None and spec.image_tokens > self.large_threshold
            spec.klass = LARGE_IMAGE if large else IMAGE
        spec.body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        return spec

    def _image(self, rng: random.Random) -> tuple[str, int, int]:
        if self.mix.uploads:
            upload = rng.choice(self.mix.uploads)
            return data_url(upload.data, upload.content_type), upload.width, upload.height
        buckets: Sequence[Bucket] = self.mix.buckets
        bucket = rng.choices(buckets, weights=[b.weight for b in buckets])[0]
        data = synthetic_jpeg(bucket.width, bucket.height, rng.randrange(VARIANTS))
        return data_url(data, "image/jpeg"), bucket.width, bucket.height
