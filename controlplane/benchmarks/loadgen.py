"""The load generator: streamed chat completions under a closed or an open loop.

Pure asyncio and httpx: no Django, no Celery. Each request streams (SSE, with
`stream_options.include_usage` so the last chunk carries the token counts) and is timed
from the moment its bytes leave until each content chunk arrives.

- closed loop: `level` workers, each sending its next request as soon as the last answers;
- open loop: Poisson arrivals at `level` requests per second, whatever the answers do.

A stage runs for its duration, then waits (up to `drain_s`) for what is in flight. The
caller's `on_tick` is awaited every `tick_s` with the progress so far; it returns True to
stop, which aborts what is in flight and keeps what has finished.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from controlplane import outbound
from controlplane.benchmarks.workload import RequestSpec

CLOSED, OPEN = "closed", "open"
DONE = object()  # the `data: [DONE]` sentinel
MAX_IN_FLIGHT = 2048  # an open loop far past capacity stops adding work here


@dataclass(frozen=True)
class Target:
    url: str  # the chat completions endpoint
    model: str
    api_key: str = ""
    timeout_s: float = 300.0
    # The address `url`'s host was vetted at, where every request goes (a URL an operator
    # set); None: the host is looked up as usual.
    pinned: outbound.Target | None = None


def _client(target: Target) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    if target.pinned is None:
        return httpx.AsyncClient(limits=limits, timeout=target.timeout_s)
    return httpx.AsyncClient(transport=outbound.AsyncPinnedTransport(target.pinned, limits=limits),
                             timeout=target.timeout_s, follow_redirects=False, trust_env=False)


@dataclass
class Sample:
    """One request as the client saw it. Times in seconds; `started` from the stage start."""

    index: int
    klass: str
    stage: int = 0
    started: float = 0.0
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    image_tokens: int = 0
    images: int = 0
    text: str = ""  # the answer, for scoring against an expected one
    logprobs: list[float] = field(default_factory=list)  # its tokens', when they were asked for

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def parse_sse_line(line: str):
    """A `data:` line's JSON, DONE for `[DONE]`, None for anything else (comments, blanks)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        return json.loads(data)
    except ValueError:
        return None


class StreamTiming:
    """Folds the chunks of one streamed answer into a Sample, given when each arrived."""

    def __init__(self, sample: Sample, sent_at: float):
        self.sample, self.sent_at = sample, sent_at
        self.last_token_at: float | None = None
        self.chunks_with_content = 0
        self.finished = False

    def feed(self, event, now: float) -> None:
        sample = self.sample
        if event is DONE:
            self.finished = True
            return
        if not isinstance(event, dict):
            return
        if isinstance(event.get("error"), dict):
            sample.error = str(event["error"].get("message") or "error in stream")[:300]
            return
        for choice in event.get("choices") or ():
            for token in ((choice.get("logprobs") or {}).get("content")) or ():
                if isinstance(token, dict) and isinstance(token.get("logprob"), int | float):
                    sample.logprobs.append(float(token["logprob"]))
            if content := (choice.get("delta") or {}).get("content"):
                self.chunks_with_content += 1
                sample.text += content
                if self.last_token_at is None:
                    sample.ttft = now - self.sent_at
                else:
                    sample.itl.append(now - self.last_token_at)
                self.last_token_at = now
        usage = event.get("usage")
        if isinstance(usage, dict):
            sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            sample.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("image_tokens") is not None:
                sample.image_tokens = int(details["image_tokens"])

    def close(self, now: float) -> Sample:
        sample = self.sample
        sample.e2e = now - self.sent_at
        if not sample.output_tokens:
            sample.output_tokens = self.chunks_with_content
        if not sample.error and not self.finished:
            sample.error = "the stream ended before [DONE]"
        if not sample.error and sample.ttft is None:
            sample.error = "no content in the answer"
        sample.ok = not sample.error
        return sample


def payload_of(target: Target, spec: RequestSpec) -> bytes:
    body = {**spec.body, "model": target.model, "stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


async def prepared(next_spec: Callable[[], RequestSpec], target: Target) -> tuple[RequestSpec, bytes] | None:
    """The next request and its body, made on a worker thread: drawing and encoding a large
    image on the event loop would stall the streams being timed. None when there are no more."""
    def make():
        try:
            spec = next_spec()
        except StopIteration:  # must not cross into a future, where it would never resolve
            return None
        return spec, payload_of(target, spec)
    return await asyncio.to_thread(make)


async def send_one(client: httpx.AsyncClient, target: Target, spec: RequestSpec, *, stage: int = 0,
                   stage_started: float = 0.0, payload: bytes | None = None) -> Sample:
    payload = payload if payload is not None else payload_of(target, spec)
    sample = Sample(index=spec.index, klass=spec.klass, stage=stage, images=spec.images,
                    image_tokens=spec.image_tokens)
    headers = {"content-type": "application/json"}
    if target.api_key:
        headers["authorization"] = f"Bearer {target.api_key}"
    sent_at = time.perf_counter()
    sample.started = sent_at - stage_started
    timing = StreamTiming(sample, sent_at)
    try:
        async with client.stream("POST", target.url, content=payload, headers=headers,
                                 timeout=target.timeout_s) as response:
            sample.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:200]
                sample.error = f"HTTP {response.status_code}: {message}"[:300]
            else:
                async for line in response.aiter_lines():
                    timing.feed(parse_sse_line(line), time.perf_counter())
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
    return timing.close(time.perf_counter())


Tick = Callable[[float], Awaitable[bool]]
StageDone = Callable[[int, list[Sample], float, bool], Awaitable[None]]


async def _never_stop(_progress: float) -> bool:
    return False


async def run_stage(client: httpx.AsyncClient, target: Target, next_spec: Callable[[], RequestSpec], *,
                    arrival: str, level: float, duration_s: float, stage: int = 0, seed: int = 0,
                    drain_s: float = 60.0, on_tick: Tick = _never_stop, tick_s: float = 0.5,
                    progress: Callable[[float], float] = lambda f: f) -> tuple[list[Sample], bool]:
    """Run one stage; return its samples and whether the caller asked to stop."""
    samples: list[Sample] = []
    in_flight: set[asyncio.Task] = set()
    started = time.perf_counter()
    deadline = started + duration_s
    stop = asyncio.Event()

    async def one():
        made = await prepared(next_spec, target)
        if made is None:
            stop.set()  # the requests ran out: this stage sends no more
            return
        spec, payload = made
        try:
            samples.append(await send_one(client, target, spec, stage=stage, stage_started=started,
                                          payload=payload))
        except asyncio.CancelledError:
            if not stopped_by_caller:  # past the drain deadline: a request the target never answered
                samples.append(Sample(index=spec.index, klass=spec.klass, stage=stage, images=spec.images,
                                      image_tokens=spec.image_tokens,
                                      error="no answer by the end of the stage's drain"))
            raise

    async def closed_worker():
        while time.perf_counter() < deadline and not stop.is_set():
            await one()

    async def open_arrivals():
        rng = random.Random(seed * 7 + stage)
        at = started
        while not stop.is_set():
            at += rng.expovariate(level)
            if at >= deadline:
                return
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            if len(in_flight) >= MAX_IN_FLIGHT:
                continue
            task = asyncio.ensure_future(one())
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    if arrival == CLOSED:
        for _ in range(max(1, int(level))):
            task = asyncio.ensure_future(closed_worker())
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        driver = None
    elif arrival == OPEN:
        if level <= 0:
            raise ValueError("an open loop needs a positive request rate")
        driver = asyncio.ensure_future(open_arrivals())
    else:
        raise ValueError(f"arrival must be {CLOSED!r} or {OPEN!r}")

    stopped_by_caller = False
    drain_deadline = deadline + drain_s
    while True:
        running = bool(in_flight) or (driver is not None and not driver.done())
        now = time.perf_counter()
        if not running or now >= drain_deadline:
            break
        if await on_tick(progress(min(1.0, (now - started) / duration_s))):
            stopped_by_caller = True
            break
        await asyncio.sleep(tick_s)
    stop.set()
    leftovers = [*in_flight, *([driver] if driver is not None else [])]
    for task in leftovers:
        task.cancel()
    await asyncio.gather(*leftovers, return_exceptions=True)
    return samples, stopped_by_caller


async def run_sweep(target: Target, next_spec: Callable[[], RequestSpec], *, arrival: str,
                    levels: list[float], duration_s: float, seed: int = 0, drain_s: float = 60.0,
                    on_tick: Tick = _never_stop, on_stage: StageDone | None = None,
                    tick_s: float = 0.5) -> tuple[list[list[Sample]], bool]:
    """Every level in turn; the samples of each stage run (a stopped one included).
    `on_stage(index, samples, elapsed_s, stopped)` is awaited as each stage ends."""
    stages: list[list[Sample]] = []
    async with _client(target) as client:
        for n, level in enumerate(levels):
            started = time.perf_counter()
            samples, stopped = await run_stage(
                client, target, next_spec, arrival=arrival, level=level, duration_s=duration_s,
                stage=n, seed=seed, drain_s=drain_s, on_tick=on_tick, tick_s=tick_s,
                progress=lambda f, n=n: (n + f) / len(levels))
            stages.append(samples)
            if on_stage is not None:
                await on_stage(n, samples, time.perf_counter() - started, stopped)
            if stopped:
                return stages, True
    return stages, False


async def run_fixed(target: Target, stages: list[list[RequestSpec]], *, concurrency: int,
                    on_tick: Tick = _never_stop, on_stage: StageDone | None = None,
                    tick_s: float = 0.5) -> tuple[list[list[Sample]], bool]:
    """Each stage's requests, `concurrency` at a time (a resolution sweep: one stage per cap)."""
    total = sum(len(stage) for stage in stages) or 1
    finished = 0
    results: list[list[Sample]] = []
    stop = asyncio.Event()

    async def ticker():
        while not stop.is_set():
            if await on_tick(finished / total):
                stop.set()
                return
            await asyncio.sleep(tick_s)

    async with _client(target) as client:
        watch = asyncio.ensure_future(ticker())
        try:
            for n, specs in enumerate(stages):
                queue = iter(specs)
                samples: list[Sample] = []
                started = time.perf_counter()

                async def worker(samples=samples, queue=queue, started=started, n=n):
                    nonlocal finished
                    for spec in queue:
                        if stop.is_set():
                            return
                        payload = await asyncio.to_thread(payload_of, target, spec)
                        samples.append(await send_one(client, target, spec, stage=n, stage_started=started,
                                                      payload=payload))
                        finished += 1

                workers = [asyncio.ensure_future(worker()) for _ in range(max(1, concurrency))]
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait([stopper, asyncio.gather(*workers)], return_when=asyncio.FIRST_COMPLETED)
                stopped = stop.is_set()
                for task in [*workers, stopper]:
                    task.cancel()
                await asyncio.gather(*workers, stopper, return_exceptions=True)
                results.append(samples)
                if on_stage is not None:
                    await on_stage(n, samples, time.perf_counter() - started, stopped)
                if stopped:
                    return results, True
        finally:
            stop.set()
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
    return results, False
