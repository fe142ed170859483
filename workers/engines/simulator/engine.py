"""The simulated engine: token accounting, an encoder cache and a timing cost model.

Cost parameters (defaults are small so that tests and demos run quickly; set them to the
figures of a real GPU to reproduce its latency shape):
- prefill_us_per_token: prompt processing per token, image tokens included. An H100 runs
  a 7B model's prefill at roughly 10-20k tokens/s, i.e. 50-100 us per token.
- encode_us_per_image_token: the vision encoder, per image token, skipped on a cache hit.
- decode_ms_per_token: one decode step per output token; a 7B model decodes at ~10-30 ms
  per step when batched.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import random
import time
from collections import OrderedDict
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from controlplane.imaging.tokens import count_image_tokens
from controlplane.textcount import prompt_text_tokens
from workers.engines.simulator.metrics import Metrics

_WORDS = ("the", "a", "of", "and", "is", "in", "on", "with", "blue", "red", "one", "two",
          "left", "top", "text", "line", "bar", "shows", "near", "edge", "sky", "tree", "cat")


class EngineRequestError(ValueError):
    pass


@dataclass
class CostModel:
    prefill_us_per_token: float = 20.0
    encode_us_per_image_token: float = 10.0
    decode_ms_per_token: float = 1.0


@dataclass
class ImageInput:
    width: int
    height: int
    tokens: int
    digest: str


@dataclass
class Completion:
    prompt_tokens: int
    image_tokens: int
    cached_image_tokens: int
    tokens: list[str]
    finish_reason: str


class SimulatedEngine:
    def __init__(self, *, served_model_name: str, family: str, mm_processor_kwargs: dict,
                 max_num_seqs: int, max_model_len: int, images_per_prompt: int | None,
                 cost: CostModel, encoder_cache_items: int = 256):
        self.name = served_model_name
        self.family = family
        self.mm_kwargs = mm_processor_kwargs
        self.max_model_len = max_model_len
        self.images_per_prompt = images_per_prompt
        self.cost = cost
        self.metrics = Metrics(served_model_name)
        self.slots = asyncio.Semaphore(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.encoder_cache: OrderedDict[str, int] = OrderedDict()
        self.encoder_cache_items = encoder_cache_items

    def parse_images(self, messages: list) -> list[ImageInput]:
        images = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "image_url":
                    continue
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                images.append(self._decode(url))
        if images and self.images_per_prompt is None:
            raise EngineRequestError(f"{self.name} is not a multimodal model")
        if self.images_per_prompt is not None and len(images) > self.images_per_prompt:
            raise EngineRequestError(
                f"At most {self.images_per_prompt} image(s) may be provided in one prompt."
            )
        return images

    def _decode(self, url) -> ImageInput:
        if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url[:100]:
            raise EngineRequestError("image_url must be a base64 data URL")
        try:
            data = base64.b64decode(url.split(",", 1)[1], validate=True)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
        except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as exc:
            raise EngineRequestError(f"cannot decode image: {exc}") from None
        tokens = count_image_tokens(self.family, width, height, **self.mm_kwargs)
        return ImageInput(width, height, tokens, hashlib.blake2b(data, digest_size=16).hexdigest())

    def _encoder_lookup(self, image: ImageInput) -> bool:
        self.metrics.counters["vllm:mm_cache_queries_total"] += 1
        if image.digest in self.encoder_cache:
            self.encoder_cache.move_to_end(image.digest)
            self.metrics.counters["vllm:mm_cache_hits_total"] += 1
            return True
        self.encoder_cache[image.digest] = image.tokens
        while len(self.encoder_cache) > self.encoder_cache_items:
            self.encoder_cache.popitem(last=False)
        return False

    def plan(self, body: dict) -> tuple[list[ImageInput], int, int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineRequestError("messages must be a non-empty list")
        images = self.parse_images(messages)
        text = prompt_text_tokens(messages)
        prompt = text + sum(i.tokens for i in images)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise EngineRequestError("max_tokens must be a positive integer")
        if prompt >= self.max_model_len:
            raise EngineRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {prompt} input tokens."
            )
        budget = self.max_model_len - prompt
        return images, prompt, min(limit or budget, budget)

    def reply_tokens(self, body: dict, images: list[ImageInput], max_tokens: int) -> tuple[list[str], str]:
        """Deterministic output: a description of what was received, then filler words."""
        seed = hashlib.sha256(repr(body.get("messages")).encode()).digest()
        rng = random.Random(seed)
        tokens = []
        for n, image in enumerate(images, 1):
            tokens += f"image {n} {image.width}x{image.height} {image.tokens} tokens .".split()
        tokens += [rng.choice(_WORDS) for _ in range(rng.randint(8, 40))]
        if len(tokens) > max_tokens:
            return tokens[:max_tokens], "length"
        return tokens, "stop"

    async def generate(self, body: dict, images: list[ImageInput], prompt_tokens: int,
                       max_tokens: int):
        """Yield (event, payload): ("first", Completion) then ("token", str) per output token."""
        arrived = time.monotonic()
        self.metrics.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.metrics.waiting -= 1
        self.metrics.running += 1
        self.metrics.kv_usage = self.metrics.running / self.max_num_seqs
        started = time.monotonic()
        finish = "abort"
        try:
            cached = [self._encoder_lookup(image) for image in images]
            encode_tokens = sum(i.tokens for i, hit in zip(images, cached, strict=True) if not hit)
            prefill = (prompt_tokens * self.cost.prefill_us_per_token
                       + encode_tokens * self.cost.encode_us_per_image_token) / 1e6
            await asyncio.sleep(prefill)
            tokens, finish_reason = self.reply_tokens(body, images, max_tokens)
            self.metrics.counters["vllm:prompt_tokens_total"] += prompt_tokens
            first = time.monotonic()
            self.metrics.histograms["vllm:request_queue_time_seconds"].observe(started - arrived)
            self.metrics.histograms["vllm:request_prefill_time_seconds"].observe(first - started)
            self.metrics.histograms["vllm:time_to_first_token_seconds"].observe(first - arrived)
            yield "first", Completion(
                prompt_tokens=prompt_tokens,
                image_tokens=sum(i.tokens for i in images),
                cached_image_tokens=sum(i.tokens for i, hit in zip(images, cached, strict=True) if hit),
                tokens=tokens,
                finish_reason=finish_reason,
            )
            last = first
            for index, token in enumerate(tokens):
                if index:
                    await asyncio.sleep(self.cost.decode_ms_per_token / 1000)
                    now = time.monotonic()
                    self.metrics.histograms["vllm:inter_token_latency_seconds"].observe(now - last)
                    last = now
                self.metrics.counters["vllm:generation_tokens_total"] += 1
                yield "token", token
            finish = finish_reason
            self.metrics.histograms["vllm:request_decode_time_seconds"].observe(time.monotonic() - first)
            self.metrics.histograms["vllm:e2e_request_latency_seconds"].observe(time.monotonic() - arrived)
        finally:
            self.metrics.success[finish] += 1
            self.metrics.running -= 1
            self.metrics.kv_usage = self.metrics.running / self.max_num_seqs
            self.slots.release()
