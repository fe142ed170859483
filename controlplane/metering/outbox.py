"""The usage stream, from Redis into the database.

With Redis, the gateway appends each request's usage to a stream before the response goes
out (controlplane/gateway/ledger/redis_store.py, in the same step that closes its journal entry and
settles its quota), and `usage_ingest` moves the stream into the database in batches, each
stored with one COPY in one transaction, the next batch read and priced meanwhile. Storing is idempotent by request id, so an entry
delivered twice (a consumer that crashed before acknowledging) is stored once. Without Redis
(embedded mode) the journal writes usage to the database directly.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
from concurrent.futures import Future, ThreadPoolExecutor

import orjson
import redis
from django.conf import settings
from django.db import connection

from controlplane.metering.records import usage_from_json
from controlplane.metering.services import usage_record, usage_rows, usage_rows_store
from controlplane.redis_clients import key_prefix, sync_redis

log = logging.getLogger(__name__)
GROUP = "ingest"
RECLAIM_IDLE_MS = 60_000  # entries a consumer took but did not acknowledge for a minute
MAX_DELIVERIES = 5
# Entries read, priced and written at a time: each batch costs a few queries and a commit
# whatever its size, and 5,000 (a few MB of rows) beat 2,000 by a tenth in bench/metering.
BATCH = 5000


def stream_key() -> str:
    return f"{key_prefix()}:usage"


def usage_ingest(*, batch: int = BATCH, max_batches: int = 10) -> int:
    """Move usage from the stream into the database. Returns the records stored or confirmed.

    Pipelined: while one batch is written to the database (on a thread of its own, waiting on
    PostgreSQL most of the time), the next is read from the stream and priced. A batch is
    acknowledged only once it is stored; one that cannot be stored whole is stored entry by
    entry. Any number of consumers may run at once, on any hosts: each takes its own entries
    from the group, and storing is idempotent by request id."""
    # A database that does not answer: nothing is taken from the stream (taken and not stored,
    # entries would wait RECLAIM_IDLE_MS to be taken again); the next run tries again.
    connection.ensure_connection()
    client = sync_redis(settings.REDIS_URL)
    key, consumer = stream_key(), f"{socket.gethostname()}-{os.getpid()}"
    try:
        client.xgroup_create(key, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    done, writing = 0, None
    # First what a crashed consumer left behind, then what is new.
    _, reclaimed, *_ = client.xautoclaim(key, GROUP, consumer, min_idle_time=RECLAIM_IDLE_MS, start_id="0-0",
                                         count=batch)
    entries = list(reclaimed)
    with _collector_paused(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-writer") as writer:
        try:
            for _round in range(max_batches):
                if not entries:
                    fresh = client.xreadgroup(GROUP, consumer, {key: ">"}, count=batch)
                    entries = fresh[0][1] if fresh else []
                if not entries:
                    break
                job = _priced(entries, writer)
                if writing is not None:
                    done += _acknowledge(client, key, *writing)
                writing, entries = (job, entries), []
            if writing is not None:
                done += _acknowledge(client, key, *writing)
        finally:
            writer.submit(connection.close)  # the writer thread's own connection
    _trim_acknowledged(client, key)
    _forget_idle_consumers(client, key, consumer)
    return done


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector held off while batches are read, priced and written:
    each event makes a few dozen objects, none in a cycle (freed as they go), and the
    collections they set off, each walking the worker's whole heap, took a quarter of the
    ingest's CPU. It runs again as soon as the ingest returns."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


CONSUMER_IDLE_MS = 3_600_000


def _forget_idle_consumers(client, key: str, consumer: str) -> None:
    """Consumers are named per process, so every restart leaves a name behind in the group:
    those holding nothing and idle for an hour are removed."""
    for other in client.xinfo_consumers(key, GROUP):
        name = other["name"].decode() if isinstance(other["name"], bytes) else other["name"]
        if name != consumer and not other["pending"] and other["idle"] > CONSUMER_IDLE_MS:
            client.xgroup_delconsumer(key, GROUP, name)


def _priced(entries: list, writer: ThreadPoolExecutor) -> Future | None:
    """The batch's rows, priced here and handed to the writer; None when some entry could
    not even be read or priced (then each is stored on its own)."""
    try:
        rows = usage_rows([usage_from_json(orjson.loads(fields[b"record"])) for _, fields in entries])
    except Exception:
        log.warning("a batch of %s usage entries could not be priced at once; storing one by one",
                    len(entries), exc_info=True)
        return None
    return writer.submit(usage_rows_store, rows)


def _acknowledge(client, key: str, job: Future | None, entries: list) -> int:
    """Once its batch is written (or, failing that, each entry on its own), acknowledge and
    delete what was stored. Returns how many entries."""
    if job is not None:
        try:
            job.result()
            ids = [entry_id for entry_id, _ in entries]
        except Exception:
            log.warning("a batch of %s usage entries could not be stored at once; storing one by one",
                        len(entries), exc_info=True)
            job = None
    if job is None:
        ids = _store_each(client, key, entries)
    if ids:
        # Both or neither (MULTI/EXEC): an entry acknowledged but left in the stream (Redis
        # paused between the two, the client timing out) would never be read again, nor
        # removed; _trim_acknowledged clears any left so by an older version.
        pipe = client.pipeline(transaction=True)
        pipe.xack(key, GROUP, *ids)
        pipe.xdel(key, *ids)
        pipe.execute()
    return len(ids)


def _trim_acknowledged(client, key: str) -> None:
    """Remove entries the group has read and acknowledged that are still in the stream: all
    of them sit below the oldest entry still pending, or, with none pending, at or below the
    last one delivered."""
    pending = client.xpending(key, GROUP)
    if pending["pending"]:
        floor = pending["min"]
    else:
        group = next((g for g in client.xinfo_groups(key) if g["name"] in (GROUP, GROUP.encode())), None)
        if group is None:
            return
        last = group["last-delivered-id"]
        millis, sequence = (last.decode() if isinstance(last, bytes) else last).split("-")
        floor = f"{millis}-{int(sequence) + 1}"
    client.xtrim(key, minid=floor)


def _store_each(client, key: str, entries: list) -> list:
    """Store entries one by one. Returns the ids to acknowledge: those stored, and those moved
    to the dead-letter stream."""
    ids = []
    for entry_id, fields in entries:
        try:
            usage_record(record=usage_from_json(orjson.loads(fields[b"record"])))
        except Exception:
            # Left unacknowledged: retried after RECLAIM_IDLE_MS, never silently dropped;
            # after MAX_DELIVERIES it waits in the dead-letter stream for an operator.
            log.exception("could not store usage entry %s", entry_id)
            pending = client.xpending_range(key, GROUP, min=entry_id, max=entry_id, count=1)
            if pending and pending[0]["times_delivered"] >= MAX_DELIVERIES:
                client.xadd(f"{key}:dead", fields)
                log.error("usage entry %s failed %s times; moved to %s:dead", entry_id, MAX_DELIVERIES, key)
                ids.append(entry_id)
            continue
        ids.append(entry_id)
    return ids
