"""Beat sends each scheduled task once however many beats run: a deploy that starts the new beat
before the old one has stopped, or a second started by mistake, would otherwise send every
task twice (twice the rollups, a scheduled benchmark run twice).

Only the beat holding the lease sends. The lease is a row in the database naming its holder,
taken when free and renewed by its holder every tick, and lost BEAT_LEASE_S after its holder
stops renewing it (stopped, or cut off), by the database's clock alone: then another beat takes
it within a tick, reads the schedule afresh from the database (the holder writes each send there
as it makes it) and sends what is due from there, nothing twice. It lives beside the schedule
rather than in Redis, so that beats go on through an outage of the gateway's Redis when their
broker is elsewhere (an alert that Redis is down is beat's to send). On SQLite (embedded mode,
one host, one beat) there is nothing to share and no lease.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid

from django.conf import settings
from django.db import connection
from django_celery_beat.schedulers import DatabaseScheduler

from controlplane.fleet.models import Lease

log = logging.getLogger(__name__)


class BeatLease:
    """The one lease beats share, held by `owner` or not."""

    def __init__(self, *, owner: str, seconds: float, name: str = "beat"):
        self.owner, self.ms, self.name = owner, int(seconds * 1000), name

    def held(self) -> bool:
        """Take or renew the lease; whether this owner holds it. One statement: taken when free
        (no row, or its time is up), renewed by its holder, else left as it is."""
        table = Lease._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (name, holder, expires_at) VALUES (%s, %s, clock_timestamp() + %s * interval '1 ms') "
                f"ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at "
                f"WHERE {table}.holder = EXCLUDED.holder OR {table}.expires_at < clock_timestamp() RETURNING holder",
                [self.name, self.owner, self.ms])
            return cursor.fetchone() is not None

    def release(self) -> None:
        Lease.objects.filter(name=self.name, holder=self.owner).delete()


class LeasedScheduler(DatabaseScheduler):
    """django-celery-beat's scheduler, sending only while this beat holds the lease."""

    def __init__(self, *args, **kwargs):
        self.lease = None
        if connection.vendor == "postgresql":
            owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
            self.lease = BeatLease(owner=owner, seconds=settings.BEAT_LEASE_S)
        self._holding = None
        super().__init__(*args, **kwargs)

    def tick(self, *args, **kwargs):
        if self.lease is not None:
            try:
                holding = self.lease.held()
            except Exception:  # the database does not answer: send nothing rather than twice
                log.warning("the beat lease cannot be read; sending nothing until it can", exc_info=True)
                connection.close()  # the next tick connects afresh
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
