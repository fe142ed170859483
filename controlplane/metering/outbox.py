"""The usage stream, from Redis into the database.

With Redis, the gateway appends each request's usage to a stream before the response goes
out (controlplane/gateway/ledger/redis_store.py, in the same step that closes its journal entry and
settles its quota), and `usage_ingest` moves the stream into the database in batches, each
stored with bulk inserts in one transaction. Storing is idempotent by request id, so an entry
delivered twice (a consumer that crashed before acknowledging) is stored once. Without Redis
(embedded mode) the journal writes usage to the database directly.
"""

from __future__ import annotations

import logging
import socket

import orjson
from django.conf import settings

from controlplane.metering.services import (
    usage_from_json,
    usage_record,
    usage_record_many,
)
from controlplane.redis_clients import key_prefix, sync_redis

log = logging.getLogger(__name__)
GROUP = "ingest"
RECLAIM_IDLE_MS = 60_000  # entries a consumer took but did not acknowledge for a minute
MAX_DELIVERIES = 5


def stream_key() -> str:
    return f"{key_prefix()}:usage"


def usage_ingest(*, batch: int = 2000, max_batches: int = 10) -> int:
    """Move usage from the stream into the database. Returns the records stored or confirmed."""
    import redis
    from django.db import connection

    # A database that does not answer: nothing is taken from the stream (taken and not stored,
    # entries would wait RECLAIM_IDLE_MS to be taken again); the next run tries again.
    connection.ensure_connection()
    client = sync_redis(settings.REDIS_URL)
    key, consumer = stream_key(), f"{socket.gethostname()}"
    try:
        client.xgroup_create(key, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    done = 0
    # First what a crashed consumer left behind, then what is new.
    _, reclaimed, *_ = client.xautoclaim(key, GROUP, consumer, min_idle_time=RECLAIM_IDLE_MS, start_id="0-0",
                                         count=batch)
    entries = list(reclaimed)
    for _round in range(max_batches):
        if not entries:
            fresh = client.xreadgroup(GROUP, consumer, {key: ">"}, count=batch)
            entries = fresh[0][1] if fresh else []
        if not entries:
            break
        ids = _store_batch(entries)
        if ids is None:
            ids = _store_each(client, key, entries)
        if ids:
            # Both or neither (MULTI/EXEC): an entry acknowledged but left in the stream (Redis
            # paused between the two, the client timing out) would never be read again, nor
            # removed; _trim_acknowledged clears any left so by an older version.
            pipe = client.pipeline(transaction=True)
            pipe.xack(key, GROUP, *ids)
            pipe.xdel(key, *ids)
            pipe.execute()
            done += len(ids)
        entries = []
    _trim_acknowledged(client, key)
    return done


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


def _store_batch(entries: list) -> list | None:
    """Store a batch in one transaction. Returns the entry ids to acknowledge, or None when
    some entry could not be stored: then each is stored (or kept back) on its own."""
    try:
        usage_record_many(records=[usage_from_json(orjson.loads(fields[b"record"])) for _, fields in entries])
    except Exception:
        log.warning("a batch of %s usage entries could not be stored at once; storing one by one",
                    len(entries), exc_info=True)
        return None
    return [entry_id for entry_id, _ in entries]


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
