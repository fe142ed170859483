"""The spool: where a finished request's usage waits when neither its ledger nor the database
can take it (the database down, and with it the database ledger, or Redis and the database
both). Appended to a file of this process's own under VAR_DIR/spool and flushed to disk
before the request counts as finished; moved into the ledger again by every gateway
process's heartbeat once the database answers, and by whoever finds a dead process's file.

Applying a spooled finish twice is harmless: storing usage is idempotent by request id, and
a journaled request's reservation is settled only by whoever removes its journal entry.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from pathlib import Path

from django.conf import settings

from controlplane.gateway.ledger.base import entry, reservation_from_json
from controlplane.metering.records import UsageRecord, usage_from_json

log = logging.getLogger(__name__)


def _dir() -> Path:
    return Path(settings.VAR_DIR) / "spool"


def pending() -> bool:
    folder = _dir()
    return folder.exists() and any(folder.iterdir())


def _claimable(folder: Path):
    for path in sorted(folder.iterdir()):
        if path.suffix == ".jsonl":
            yield path
        elif path.suffix == ".draining":  # a drainer's: claimable once that process is gone
            try:
                os.kill(int(path.name.rsplit(".", 2)[-2]), 0)
            except (ProcessLookupError, ValueError):
                yield path
            except PermissionError:
                pass


class Spool:
    """A gateway process's own spool file (its name is the process's, so another process can
    tell whether it still appends to it) and the lock its appends and its drain share."""

    def __init__(self):
        self.name = f"usage-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._lock = threading.Lock()

    def write(self, record: UsageRecord, *, journaled: bool, ledger: str) -> None:
        """Keep a finished request's usage on disk until its ledger can take it."""
        line = json.dumps({"record": entry(record), "journaled": journaled, "ledger": ledger}) + "\n"
        folder = _dir()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._lock:
            fd = os.open(folder / self.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        log.warning("usage of %s spooled to disk until the database answers", record.request_id)

    def drain(self, apply) -> int:
        """Move spooled finishes into their ledger with `apply(record, journaled, ledger)`, file by
        file; stops at the first that fails (the database still down), keeping it and the rest.
        Returns how many were applied."""
        folder, done = _dir(), 0
        if not folder.exists():
            return 0
        for path in list(_claimable(folder)):
            claimed = path.with_name(f"{path.name.split('.jsonl')[0]}.jsonl.{os.getpid()}.draining")
            try:
                if path == folder / self.name:
                    with self._lock:  # this process's own: no append half-way through the rename
                        path.rename(claimed)
                else:
                    path.rename(claimed)
            except FileNotFoundError:
                continue  # another drainer took it
            lines = claimed.read_text().splitlines()
            for index, line in enumerate(lines):
                data = json.loads(line)
                record = usage_from_json(data["record"])
                if data["record"].get("reservation"):
                    record.reservation = reservation_from_json(data["record"]["reservation"])
                try:
                    apply(record, data["journaled"], data["ledger"])
                except Exception as exc:
                    rest = claimed.with_name(f"usage-{uuid.uuid4().hex}.jsonl")
                    rest.write_text("".join(f"{kept}\n" for kept in lines[index:]))
                    os.chmod(rest, 0o600)
                    claimed.unlink()
                    log.warning("spooled usage still waits for the database (%s left): %s", len(lines) - index, exc)
                    return done
                done += 1
            claimed.unlink()
        if done:
            log.warning("moved %s spooled usage records into the ledger", done)
        return done
