"""The engines requests wait on, watched: one found hung or dead by supervision fails the
requests waiting on it at once, instead of at the upstream timeout, minutes later."""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings

from controlplane.gateway import state
from controlplane.gateway.apps import current_process
from controlplane.gateway.stopping import STREAMS_ENDING

log = logging.getLogger(__name__)


class EngineFailing(Exception):
    """Supervision found the engine a request waits on hung or dead."""


class EngineWatch:
    """One per event loop: every GATEWAY_ENGINE_WATCH_S, the engines that requests wait on are
    looked up among their tiers' failing ones, and the requests waiting on those are told.
    One task for every request in flight, not one per request."""

    def __init__(self):
        self.waits: dict[object, tuple[int, int, object]] = {}  # token -> (tier, instance, callback)
        self.task: asyncio.Task | None = None

    def add(self, tier_id: int, instance_id: int, callback) -> object:
        token = object()
        self.waits[token] = (tier_id, instance_id, callback)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        return token

    def remove(self, token) -> None:
        self.waits.pop(token, None)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(settings.GATEWAY_ENGINE_WATCH_S)
            for tier_id in {tier for tier, _, _ in self.waits.values()}:
                try:
                    failing = await state.failing(tier_id)
                except Exception:  # the database does not answer: no news, keep waiting
                    log.warning("could not check the engines of tier %s", tier_id)
                    continue
                for token, (tier, instance_id, callback) in list(self.waits.items()):
                    if tier == tier_id and instance_id in failing:
                        self.waits.pop(token, None)
                        callback()


def _loop_watch() -> EngineWatch:
    loop = asyncio.get_running_loop()
    watches = current_process().engine_watches
    watch = watches.get(loop)
    if watch is None:
        watch = watches[loop] = EngineWatch()
    return watch


async def unless_engine_fails(awaitable, tier_id: int, instance_id: int):
    """`awaitable`'s result, or EngineFailing once its engine is found hung or dead (what
    would otherwise wait for the upstream timeout, minutes)."""
    task, failed = asyncio.current_task(), []

    def engine_failed():
        failed.append(True)
        task.cancel()

    token = _loop_watch().add(tier_id, instance_id, engine_failed)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if failed and task.uncancel() == 0:  # only the watch cancelled it, not the client leaving
            raise EngineFailing(instance_id) from None
        raise
    finally:
        _loop_watch().remove(token)


_END = object()


async def watched_lines(response, tier_id: int, instance_id: int):
    """The lines of a streamed answer, read by a task of their own, ending in EngineFailing
    if the engine is found hung or dead meanwhile; STREAMS_ENDING among them as soon as this
    process ends its open streams, however long the engine has been silent."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump():
        try:
            async for line in response.lines():
                queue.put_nowait(line)
            queue.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)

    pumping = asyncio.ensure_future(pump())
    token = _loop_watch().add(tier_id, instance_id, lambda: queue.put_nowait(EngineFailing(instance_id)))
    forget_stream = current_process().stopping.when_streams_end(lambda: queue.put_nowait(STREAMS_ENDING))
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        _loop_watch().remove(token)
        forget_stream()
        pumping.cancel()
