"""Beat sends each scheduled task once however many beats run: a deploy that starts the new beat
before the old one has stopped, or a second started by mistake, would otherwise send every
task twice (twice the rollups, a scheduled benchmark run twice).

Only the beat holding the lease sends. The lease is a Redis key naming its holder, taken when
free and renewed by its holder every tick, and lost BEAT_LEASE_S after its holder stops
renewing it (stopped, or cut off): then another beat takes it within a tick, reads the
schedule afresh from the database (the holder writes each send there as it makes it) and
sends what is due from there, nothing twice. Without Redis
(embedded mode, one host, one beat) there is nothing to share and no lease.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid

from django.conf import settings
from django_celery_beat.schedulers import DatabaseScheduler

from controlplane.redis_clients import key_prefix, sync_redis

log = logging.getLogger(__name__)

# Taken when free, or renewed by its holder; the holder's name when held, else nil.
_TAKE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return holder
"""
# Given up by its holder only.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class BeatLease:
    """The one lease beats share, held by `owner` or not."""

    def __init__(self, client, *, owner: str, seconds: float, key: str):
        self.client, self.owner, self.ms, self.key = client, owner, int(seconds * 1000), key
        self._take, self._release = client.register_script(_TAKE), client.register_script(_RELEASE)

    def held(self) -> bool:
        """Take or renew the lease; whether this owner holds it."""
        holder = self._take(keys=[self.key], args=[self.owner, self.ms])
        return (holder.decode() if isinstance(holder, bytes) else holder) == self.owner

    def release(self) -> None:
        self._release(keys=[self.key], args=[self.owner])


class LeasedScheduler(DatabaseScheduler):
    """django-celery-beat's scheduler, sending only while this beat holds the lease."""

    def __init__(self, *args, **kwargs):
        self.lease = None
        if settings.REDIS_URL:
            owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
            self.lease = BeatLease(sync_redis(settings.REDIS_URL), owner=owner, seconds=settings.BEAT_LEASE_S,
                                   key=f"{key_prefix()}:beat:lease")
        self._holding = None
        super().__init__(*args, **kwargs)

    def tick(self, *args, **kwargs):
        if self.lease is not None:
            try:
                holding = self.lease.held()
            except Exception:  # Redis does not answer: send nothing rather than twice
                log.warning("the beat lease cannot be read; sending nothing until it can", exc_info=True)
                holding = False
            if holding != self._holding:
                log.warning("this beat %s the lease", "holds" if holding else "does not hold")
                if holding:
                    # What the beat before it sent is in the database (written after each send):
                    # read the schedule afresh, or this beat would send it again.
                    self._last_full_sync = datetime.datetime.now() - datetime.timedelta(days=1)
                self._holding = holding
            if not holding:
                return settings.BEAT_LEASE_S / 3
            # Back before the lease runs out, however long until the next task is due.
            return min(super().tick(*args, **kwargs), settings.BEAT_LEASE_S / 3)
        return super().tick(*args, **kwargs)

    def close(self):
        try:
            super().close()  # what it sent, written first
        finally:
            if self.lease is not None and self._holding:
                self._holding = False
                self.lease.release()  # the next beat need not wait the lease out
