"""The simulated engine's front half: request checks, token accounting and replies.

It decodes the images a request carries, counts their tokens with the gateway's family
formulas, lays the prompt out (where each image sits, the keys of its KV blocks) and
hands a Sequence to the Scheduler (scheduler.py), which owns timing, batching, KV and the
caches; the cost parameters and what a real GPU has are described there.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import math
import random
import time
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from controlplane.imaging.tokens import count_image_tokens, engine_image_tokens
from controlplane.textcount import (
    MESSAGE_OVERHEAD,
    REPLY_PRIMER,
    count_text_tokens,
    prompt_text_tokens,
)
from workers.engines.simulator.caches import ImageCache, block_keys
from workers.engines.simulator.metrics import Metrics
from workers.engines.simulator.scheduler import (
    FAULT_MODES,
    CostModel,
    Faults,
    Scheduler,
    SchedulerConfig,
)
from workers.engines.simulator.sequence import BLOCK_SIZE, ImageSpan, Sequence
from workers.engines.simulator.validation import EngineRequestError, check_options

__all__ = ["CostModel", "EngineDead", "EngineRequestError", "Faults", "SimulatedEngine"]

_WORDS = ("the", "a", "of", "and", "is", "in", "on", "with", "blue", "red", "one", "two",
          "left", "top", "text", "line", "bar", "shows", "near", "edge", "sky", "tree", "cat")


class EngineDead(RuntimeError):
    pass


@dataclass
class ImageInput:
    width: int
    height: int
    tokens: int
    digest: str


@dataclass
class Prompt:
    tokens: int
    max_tokens: int
    priority: int
    spans: list[tuple[int, ImageInput]]  # (prompt position, image)
    block_keys: list[str]  # one per full KV block of the prompt

    @property
    def images(self) -> list[ImageInput]:
        return [image for _, image in self.spans]


@dataclass
class Completion:
    prompt_tokens: int
    image_placeholder_tokens: int
    cached_tokens: int
    created_cache_tokens: int
    tokens: list[str]
    finish_reason: str


def _number(name: str, value, valid) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EngineRequestError(f"{name} must be a number")
    if not valid(value):
        raise EngineRequestError(f"{name} {value} is out of range")
    return float(value)


class SimulatedEngine:
    def __init__(self, *, served_model_name: str, family: str, mm_processor_kwargs: dict,
                 max_num_seqs: int, max_model_len: int, images_per_prompt: int | None,
                 cost: CostModel, encoder_cache_items: int = 256, processor_cache_items: int = 256,
                 max_num_batched_tokens: int = 8192, kv_cache_tokens: int = 65536,
                 scheduling_policy: str = "fcfs", enable_prefix_caching: bool = False,
                 block_size: int = BLOCK_SIZE,
                 auto_tool_choice: bool = False, max_image_pixels: int | None = None,
                 faults: Faults | None = None, clock=time.monotonic, sleep=asyncio.sleep):
        self.name = served_model_name
        self.family = family
        self.mm_kwargs = mm_processor_kwargs
        self.images_per_prompt = images_per_prompt
        self.auto_tool_choice = auto_tool_choice
        self.max_image_pixels = max_image_pixels  # VLLM_MAX_IMAGE_PIXELS; None: no limit
        self.cost = cost
        self.metrics = Metrics(served_model_name)
        self.processor_cache = ImageCache(processor_cache_items)
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, kv_cache_tokens,
                                 scheduling_policy or "fcfs", enable_prefix_caching, block_size)
        self.scheduler = Scheduler(config, cost, self.metrics, faults=faults, clock=clock,
                                   sleep=sleep, encoder_cache=ImageCache(encoder_cache_items))
        self.metrics.kv_blocks, self.metrics.block_size = self.scheduler.total_blocks, block_size
        # vLLM refuses to start when one sequence of max_model_len cannot fit in the KV
        # cache; the simulator shrinks max_model_len to the KV instead.
        self.max_model_len = min(max_model_len, self.scheduler.total_blocks * block_size)
        self.max_num_seqs = max_num_seqs

    @property
    def faults(self) -> Faults:
        return self.scheduler.faults

    def set_fault(self, mode, factor=None, rate=None) -> Faults:
        """Inject a fault ("none" clears it); factor and rate keep their defaults when None."""
        if mode not in FAULT_MODES:
            raise EngineRequestError(f"mode must be one of {', '.join(FAULT_MODES)}")
        faults = Faults(mode)
        if factor is not None:
            faults.factor = _number("factor", factor, lambda v: v > 0)
        if rate is not None:
            faults.rate = _number("rate", rate, lambda v: 0 <= v <= 1)
        self.scheduler.set_fault(faults)
        return faults

    def _decode(self, url) -> ImageInput:
        if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url[:100]:
            raise EngineRequestError("image_url must be a base64 data URL")
        try:
            data = base64.b64decode(url.split(",", 1)[1], validate=True)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
        except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as exc:
            raise EngineRequestError(f"cannot decode image: {exc}") from None
        # vLLM checks the size as it opens the image, before its processor (and so before
        # any token count) sees it.
        if self.max_image_pixels and width * height > self.max_image_pixels:
            raise EngineRequestError(
                f"Image dimensions {width}x{height} ({width * height} pixels) exceed the maximum of "
                f"{self.max_image_pixels} pixels. Set VLLM_MAX_IMAGE_PIXELS to increase this limit.")
        tokens = count_image_tokens(self.family, width, height, **self.mm_kwargs)
        return ImageInput(width, height, tokens, hashlib.blake2b(data, digest_size=16).hexdigest())

    def _layout(self, messages: list) -> tuple[list, list]:
        """Images at their prompt positions, and the prompt as runs of (what, positions).

        A run is one kind of positions: a message's opening (by role), a text (by a hash of
        its content), an image (by its digest), the reply primer. Two prompts share a block
        exactly when its runs match, as vLLM's block hashes see the tokens (except that a
        text which only starts like another counts as wholly different here)."""
        spans, runs, position = [], [], 0

        def add(what: str, tokens: int) -> None:
            nonlocal position
            runs.append((what, tokens))
            position += tokens

        for message in messages:
            if not isinstance(message, dict):
                raise EngineRequestError("each message must be an object")
            content = message.get("content")
            add(f"turn:{message.get('role')}", MESSAGE_OVERHEAD)
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts if isinstance(parts, list) else ():
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "text":
                    text = str(part.get("text", ""))
                    add(f"text:{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}",
                        count_text_tokens(text))
                elif part.get("type") == "image_url":
                    spec = part.get("image_url")
                    image = self._decode(spec.get("url") if isinstance(spec, dict) else spec)
                    spans.append((position, image))
                    add(f"image:{image.digest}", image.tokens)
        add("reply", REPLY_PRIMER)
        return spans, runs

    def plan(self, body: dict) -> Prompt:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineRequestError("messages must be a non-empty list")
        check_options(body, auto_tool_choice=self.auto_tool_choice)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise EngineRequestError("cache_salt must be a non-empty string")
        priority = body.get("priority") or 0
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise EngineRequestError("priority must be an integer")
        if self.scheduler.config.policy != "priority":
            priority = 0  # vLLM 0.32 takes a priority under fcfs and ignores it
        spans, runs = self._layout(messages)
        images = [image for _, image in spans]
        if images and self.images_per_prompt is None:
            raise EngineRequestError(f"{self.name} is not a multimodal model")
        if self.images_per_prompt is not None and len(images) > self.images_per_prompt:
            raise EngineRequestError(
                f"At most {self.images_per_prompt} image(s) may be provided in one prompt."
            )
        # vLLM's processor cache: every image of every request is looked up as it is
        # processed, before the prompt is checked or scheduled. Its key (the image and the
        # processor kwargs) is the digest here, as the kwargs are the engine's own.
        for image in images:
            self.metrics.counters["vllm:mm_cache_queries_total"] += 1
            if self.processor_cache.lookup(image.digest, image.tokens):
                self.metrics.counters["vllm:mm_cache_hits_total"] += 1
        prompt = prompt_text_tokens(messages) + sum(i.tokens for i in images)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise EngineRequestError("max_tokens must be a positive integer")
        if prompt >= self.max_model_len:
            raise EngineRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {prompt} input tokens."
            )
        budget = self.max_model_len - prompt
        keys = block_keys(runs, self.scheduler.config.block_size, salt)
        return Prompt(prompt, min(limit or budget, budget), priority, spans, keys)

    def _placeholder_tokens(self, image: ImageInput) -> int:
        """What vLLM reports as the image's tokens (its placeholder, without Qwen-VL's two
        markers); the image's prompt positions for a family where no difference is known."""
        counted = engine_image_tokens(self.family, image.tokens)
        return image.tokens if counted is None else counted

    def reply_tokens(self, body: dict, images: list[ImageInput], max_tokens: int) -> tuple[list[str], str]:
        """Deterministic output: a description of what was received, then filler words."""
        seed = hashlib.sha256(repr(body.get("messages")).encode()).digest()
        rng = random.Random(seed)
        tokens = []
        for n, image in enumerate(images, 1):
            tokens += f"image {n} {image.width}x{image.height} {image.tokens} tokens .".split()
        tokens += [rng.choice(_WORDS) for _ in range(rng.randint(8, 40))]
        # vLLM's sampling extras: ignore_eos runs to max_tokens, min_tokens holds the end off.
        least = max_tokens if body.get("ignore_eos") is True else int(body.get("min_tokens") or 0)
        while len(tokens) < min(least, max_tokens):
            tokens.append(rng.choice(_WORDS))
        if len(tokens) > max_tokens or (len(tokens) == max_tokens and body.get("ignore_eos") is True):
            return tokens[:max_tokens], "length"
        return tokens, "stop"

    @staticmethod
    def token_logprob(prompt: Prompt) -> float:
        """How sure the simulated model is of each token it says: of a text prompt, nearly; of
        pictures, the surer the more of them it sees (their image tokens), as a model that
        reads is at a higher resolution."""
        if not prompt.images:
            return math.log(0.98)
        seen = sum(image.tokens for image in prompt.images)
        return math.log(max(1e-6, 0.98 * (1 - math.exp(-seen / 256))))

    async def generate(self, body: dict, prompt: Prompt):
        """Yield ("first", Completion) with the first token, then ("token", str) per token.
        Leaving the iteration early (or being cancelled) aborts the sequence."""
        tokens, finish_reason = self.reply_tokens(body, prompt.images, prompt.max_tokens)
        seq = Sequence(prompt.tokens, tokens, finish_reason, prompt.priority,
                       images=[ImageSpan(at, i.tokens, i.digest) for at, i in prompt.spans],
                       block_keys=prompt.block_keys)
        try:
            self.scheduler.submit(seq)
        except RuntimeError as exc:
            raise EngineDead(str(exc)) from None
        first = True
        try:
            while True:
                kind, payload = await seq.events.get()
                if kind == "error":
                    raise EngineDead(payload)
                if kind == "finish":
                    return
                if first:
                    first = False
                    yield "first", Completion(
                        prompt_tokens=prompt.tokens,
                        image_placeholder_tokens=sum(map(self._placeholder_tokens, prompt.images)),
                        cached_tokens=seq.cached_tokens,
                        created_cache_tokens=seq.created_cache_tokens,
                        tokens=tokens,
                        finish_reason=finish_reason,
                    )
                yield "token", payload
        finally:
            if seq.state != "finished":
                self.scheduler.abort(seq)
