"""Continuous batching in the shape of vLLM v1's scheduler: one engine loop runs steps.

A step, in order:
1. Intake: new and aborted requests reach the engine (a hung loop sees neither).
2. KV room for running sequences, in scheduling order: a sequence whose next token needs a
   new block (of block_size tokens, 16 by default as on a GPU) and finds none free
   preempts (recompute-style, as vLLM v1) the running sequence that comes last in
   scheduling order, possibly itself: it goes back to waiting with its KV freed and later
   prefills its prompt and output so far again.
3. Admission, unless step 2 preempted: waiting sequences, in scheduling order, join the
   running set while it has fewer than max_num_seqs and the free KV holds the sequence's
   tokens (all of its prompt is allocated on admission). The first that does not fit
   stops admission (head-of-line, as vLLM). Order: "fcfs" by arrival; "priority" by the
   request's `priority` (lower first), then arrival.
4. Token budget (max_num_batched_tokens): each decoding sequence takes 1 token first, the
   rest goes to prefill chunks of prefilling sequences in scheduling order (chunked
   prefill). A chunk that reaches an image not yet encoded runs the vision encoder on the
   whole image unless the encoder cache holds it.
5. The step takes its time; then each decoding sequence emits one token and a sequence
   whose prefill completed emits its first token. A sequence finishes at its last token.

Step time = step_overhead_ms + prefilled tokens x prefill_us_per_token
          + image tokens encoded x encode_us_per_image_token
          + decoding sequences x decode_ms_per_token.
What a real GPU has, e.g. an H100 running a 7B VLM in bf16 (defaults are far smaller so
that tests and demos run quickly):
- prefill_us_per_token: 50-100 us (10-20k prompt tokens/s), image positions included.
- encode_us_per_image_token: the vision encoder, 20-60 us per image token.
- decode_ms_per_token: what each running sequence adds to a decode step (its KV reads,
  growing with context), 0.1-0.5 ms.
- step_overhead_ms: the fixed cost of any step (reading the weights once, scheduling,
  sampling), 5-10 ms. Batching amortises it: a decode step lands at 10-30 ms whether it
  carries 1 sequence or 32, so a GPU-shaped setting has overhead >> per-sequence cost
  (the defaults, 0.5 and 1.0 ms, are the other way round: set both to model batching).
kv_cache_tokens: the KV pool, in blocks of block_size tokens. 80 GB x 0.9 minus 16 GB of
weights at 57 KB/token is about 1M tokens for a 7B model; a 3B model on a 24 GB card
holds about 300k.

Prefix cache (when enabled), in whole KV blocks as vLLM's: on admission the prompt's
leading blocks found in the cache (keyed by their content chained from the first block,
images by digest, cache_salt in the first; see caches.block_keys) count as computed, but
never the prompt's last token, which vLLM always computes again (its logits start the
reply). vllm:prefix_cache_queries_total / _hits_total grow by the sequence's tokens / the
hit tokens. A prefill chunk caches the full prompt blocks computed so far. Reported
cached_tokens = the hit at first admission, created_cache_tokens = the prompt's full blocks
that were not a hit (encoder-cache hits save encoding only, not prefill).
Simplifications: a preempted sequence keeps its images encoded; sequences sharing a prefix
do not share KV blocks; blocks of generated tokens are not cached.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from dataclasses import dataclass

from workers.engines.simulator.caches import ImageCache, PrefixCache
from workers.engines.simulator.metrics import Metrics
from workers.engines.simulator.sequence import BLOCK_SIZE, Sequence, Step, blocks

POLICIES = ("fcfs", "priority")
FAULT_MODES = ("none", "crash", "hang", "slow", "error_rate")
log = logging.getLogger(__name__)


@dataclass
class CostModel:
    prefill_us_per_token: float = 20.0
    encode_us_per_image_token: float = 10.0
    decode_ms_per_token: float = 1.0
    step_overhead_ms: float = 0.5


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    kv_cache_tokens: int = 65536
    policy: str = "fcfs"
    enable_prefix_caching: bool = False
    block_size: int = BLOCK_SIZE


@dataclass
class Faults:
    """An injected fault: hang stops the loop, slow stretches every step by `factor`,
    error_rate fails that fraction of requests (the server's part), crash exits."""
    mode: str = "none"
    factor: float = 10.0
    rate: float = 1.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, cost: CostModel, metrics: Metrics, *,
                 encoder_cache: ImageCache | None = None, faults: Faults | None = None,
                 clock=time.monotonic, sleep=asyncio.sleep):
        if config.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}")
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1 or config.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be positive")
        self.config, self.cost, self.metrics = config, cost, metrics
        self.encoder_cache = encoder_cache or ImageCache()
        self.faults = faults or Faults()
        self.clock, self.sleep = clock, sleep
        self.total_blocks = max(1, config.kv_cache_tokens // config.block_size)
        self.prefix_cache = PrefixCache(self.total_blocks) if config.enable_prefix_caching else None
        self.free_blocks = self.total_blocks
        self.inbox: list[Sequence] = []
        self.aborts: list[Sequence] = []
        self.waiting: list[Sequence] = []  # in scheduling order
        self.running: list[Sequence] = []  # in scheduling order
        self.steps = 0
        self.dead: BaseException | None = None
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def key(self, seq: Sequence) -> tuple[int, int]:
        return (seq.priority if self.config.policy == "priority" else 0, seq.arrival)

    # -- the API side ------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if self.dead is not None:
            raise RuntimeError(f"engine is dead: {self.dead}")
        seq.arrival, seq.arrived_at = next(self._arrivals), self.clock()
        if seq.images:
            self.metrics.image_prefills += 1
            self.metrics.image_prefills_peak = max(self.metrics.image_prefills_peak, self.metrics.image_prefills)
        self.inbox.append(seq)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    def abort(self, seq: Sequence) -> None:
        if seq.state != "finished" and not seq.aborted:
            seq.aborted = True
            self.aborts.append(seq)
            self._wake.set()

    def set_fault(self, faults: Faults) -> None:
        self.faults = faults
        self._wake.set()

    # -- the engine loop -----------------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if self.faults.mode == "hang":
                    await self._wake.wait()
                    continue
                self.intake()
                step = self.schedule()
                if not step.decodes and not step.chunks:
                    await self._wake.wait()
                    continue
                factor = self.faults.factor if self.faults.mode == "slow" else 1.0
                await self.sleep(step.duration * factor)
                self.complete(step)
        except Exception as exc:  # a bug: fail every request, /health turns 503
            log.exception("simulator engine loop died")
            self.dead = exc
            for seq in self.inbox + self.waiting + self.running:
                seq.events.put_nowait(("error", str(exc)))

    def intake(self) -> None:
        for seq in self.inbox:
            seq.state = "waiting"
            self._insert(self.waiting, seq)
        self.inbox.clear()
        for seq in self.aborts:
            for queue in (self.waiting, self.running):
                if seq in queue:
                    queue.remove(seq)
            self._finish(seq, "abort", self.clock())
        self.aborts.clear()
        self._gauges()

    def schedule(self) -> Step:
        now, preempted = self.clock(), False
        for seq in list(self.running):  # room for each running sequence's next token
            while seq.state == "running" and self._blocks(seq.num_tokens) > seq.blocks:
                if self.free_blocks:
                    self.free_blocks -= 1
                    seq.blocks += 1
                else:
                    self._preempt(max(self.running, key=self.key))
                    preempted = True
        while (not preempted and self.waiting and len(self.running) < self.config.max_num_seqs
               and self._blocks(self.waiting[0].num_tokens) <= self.free_blocks):
            self._admit(self.waiting.pop(0), now)
        budget = self.config.max_num_batched_tokens
        decodes = [seq for seq in self.running if seq.output and seq.num_tokens - seq.num_computed == 1]
        decodes = decodes[:budget]
        budget -= len(decodes)
        chunks, prefill, encode, decoding = [], 0, 0, set(map(id, decodes))
        for seq in self.running:
            left = seq.num_tokens - seq.num_computed
            if budget and id(seq) not in decoding and left:
                n = min(left, budget)
                chunks.append((seq, n))
                budget -= n
                prefill += n
                encode += self._encode(seq, seq.num_computed, seq.num_computed + n)
        cost = self.cost
        duration = (cost.step_overhead_ms / 1e3 + prefill * cost.prefill_us_per_token / 1e6
                    + encode * cost.encode_us_per_image_token / 1e6
                    + len(decodes) * cost.decode_ms_per_token / 1e3)
        self._gauges()
        return Step(decodes, chunks, duration)

    def complete(self, step: Step) -> None:
        now = self.clock()
        self.steps += 1
        for seq in step.decodes:
            if seq.state == "running" and not seq.aborted:
                seq.num_computed += 1
                self._emit(seq, now)
        for seq, n in step.chunks:
            if seq.state == "running" and not seq.aborted:
                seq.num_computed += n
                if self.prefix_cache is not None:
                    full = min(seq.num_computed, seq.prompt_tokens) // self.config.block_size
                    self.prefix_cache.insert(seq.block_keys[:full])
                if seq.num_computed == seq.num_tokens:
                    self._emit(seq, now)
        self._gauges()

    # -- helpers -------------------------------------------------------------------------
    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self.key)

    def _blocks(self, tokens: int) -> int:
        return blocks(tokens, self.config.block_size)

    def _admit(self, seq: Sequence, now: float) -> None:
        seq.blocks = self._blocks(seq.num_tokens)
        self.free_blocks -= seq.blocks
        seq.state = "running"
        self._insert(self.running, seq)
        if seq.scheduled_at is None:
            seq.scheduled_at = now
            self.metrics.histograms["vllm:request_queue_time_seconds"].observe(now - seq.arrived_at)
        hit, size = 0, self.config.block_size
        if self.prefix_cache is not None:
            found = self.prefix_cache.lookup(seq.block_keys) * size
            hit = min(found, (seq.num_tokens - 1) // size * size)  # the last token is computed
            self.metrics.counters["vllm:prefix_cache_queries_total"] += seq.num_tokens
            self.metrics.counters["vllm:prefix_cache_hits_total"] += hit
        if seq.prefix_hit is None:
            seq.prefix_hit = hit
            if self.prefix_cache is not None:
                seq.created_cache_tokens = seq.prompt_tokens // size * size - hit
        seq.num_computed = hit
        for image in seq.images:  # wholly inside the cached prefix: no encoder needed
            if image.start + image.tokens <= hit:
                image.encoded = True

    def _encode(self, seq: Sequence, start: int, end: int) -> int:
        """Image tokens the encoder runs for the chunk [start, end) of `seq`."""
        work = 0
        for image in seq.images:
            if image.encoded or image.start >= end or image.start + image.tokens <= start:
                continue
            image.encoded = True
            if self.encoder_cache.lookup(image.digest, image.tokens):
                inside = max(0, (seq.prefix_hit or 0) - image.start)
                seq.encoder_hit_tokens += max(0, image.tokens - inside)
            else:
                work += image.tokens
        return work

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks, seq.num_computed, seq.state = 0, 0, "waiting"
        self._insert(self.waiting, seq)
        self.metrics.counters["vllm:num_preemptions_total"] += 1

    def _emit(self, seq: Sequence, now: float) -> None:
        token = seq.reply[seq.output]
        seq.output += 1
        hist = self.metrics.histograms
        self.metrics.counters["vllm:generation_tokens_total"] += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            if seq.images:
                self.metrics.image_prefills -= 1
            self.metrics.counters["vllm:prompt_tokens_total"] += seq.prompt_tokens
            hist["vllm:time_to_first_token_seconds"].observe(now - seq.arrived_at)
            hist["vllm:request_prefill_time_seconds"].observe(now - seq.scheduled_at)
        else:
            hist["vllm:inter_token_latency_seconds"].observe(now - seq.last_token_at)
        seq.last_token_at = now
        seq.events.put_nowait(("token", token))
        if seq.output == len(seq.reply):
            self.running.remove(seq)
            self._finish(seq, seq.finish_reason, now)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if seq.state == "finished":
            return
        self.free_blocks += seq.blocks
        seq.blocks, seq.state = 0, "finished"
        if seq.images and seq.first_token_at is None:  # ended before its first token
            self.metrics.image_prefills -= 1
        self.metrics.success[reason] += 1
        if reason != "abort":
            hist = self.metrics.histograms
            hist["vllm:request_decode_time_seconds"].observe(now - seq.first_token_at)
            hist["vllm:e2e_request_latency_seconds"].observe(now - seq.arrived_at)
        seq.events.put_nowait(("finish", reason))

    def _gauges(self) -> None:
        self.metrics.running = len(self.running)
        self.metrics.waiting = len(self.waiting)
        self.metrics.kv_usage = (self.total_blocks - self.free_blocks) / self.total_blocks
