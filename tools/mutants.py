"""Break the code on purpose and check that its tests notice.

    python -m tools.mutants [NAME ...]

Each mutant below is a one-line change that a careless edit could make, beside the tests that
must fail for it. A clean copy of the last commit is made under a temporary directory (the
working tree is never touched); each mutant is applied there alone, its tests are run on a
database and a Redis db of their own, and the mutant is undone. A mutant whose tests all pass
is a test that cannot fail: the tool exits non-zero and names it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    original: str
    broken: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant("a plan counts as priced by a rate that starts later",
           "controlplane/catalog/models.py", "effective_from__lte=when", "effective_from__gte=when",
           ("tests/controlplane/metering/test_ratebook.py",)),
    Mutant("a new rate may start inside what its plan already billed",
           "controlplane/catalog/models.py", "        if last is not None:\n            raise RateInUse",
           "        if False:\n            raise RateInUse",
           ("tests/controlplane/catalog/test_billed_rates.py",)),
    Mutant("a tier that billed may change its plan's currency",
           "controlplane/catalog/models.py", "self.usage_events.exclude(rate=None).exists()",
           "self.usage_events.filter(rate=None).exists()",
           ("tests/controlplane/catalog/test_billed_rates.py",)),
    Mutant("a cache entry is never reloaded ahead of its end",
           "controlplane/gateway/ttl_cache.py", "item[0] - now < self.seconds / 4", "item[0] - now < 0",
           ("tests/controlplane/gateway/test_state.py",)),
    Mutant("the finish script leaves the journal entry behind",
           "controlplane/gateway/ledger/redis_scripts.py",
           "local held = redis.call('HDEL', KEYS[1], ARGV[1])", "local held = 1",
           ("tests/controlplane/gateway/test_journal.py", "tests/controlplane/gateway/test_ledger.py")),
    Mutant("spooled usage is dropped instead of moved into the ledger",
           "controlplane/gateway/ledger/spool.py", "                apply(record, data[\"journaled\"], data[\"ledger\"])",
           "                pass",
           ("tests/controlplane/gateway/test_database_outage.py",)),
    Mutant("the tenant list reads each tenant's keys one query at a time",
           "controlplane/tenants/views/tenants.py", 'Tenant.objects.prefetch_related("allowed_tiers")',
           "Tenant.objects",
           ("tests/controlplane/test_query_counts.py",)),
    Mutant("freed prefill slots go to the same tenant again and again",
           "controlplane/gateway/prefill.py",
           "    if redis.call('LLEN', queue) > 0 then redis.call('RPUSH', ring, tenant) end",
           "    if redis.call('LLEN', queue) > 0 then redis.call('LPUSH', ring, tenant) end",
           ("tests/controlplane/gateway/test_prefill_slots.py",)),
    Mutant("an image request keeps its prefill slot past its first token",
           "controlplane/gateway/relaying.py",
           "                if slot is not None and slot.held:\n                    await slot.release()",
           "                if False:\n                    await slot.release()",
           ("tests/controlplane/gateway/test_prefill_engine_side.py",)),
    Mutant("a picture's engine depends on the replica that routes it",
           "controlplane/gateway/routing.py", 'xxhash.xxh64_intdigest(f"{image}|{c.id}")',
           'xxhash.xxh64_intdigest(f"{image}|{c.id}|{id(engines)}")',
           ("tests/controlplane/gateway/test_routing.py",)),
    Mutant("a benchmark run whose worker died blocks its schedule",
           "controlplane/benchmarks/services.py", "filter(silent | too_long)", "filter(too_long)",
           ("tests/controlplane/benchmarks/test_stalled_runs.py",)),
)


def _copy_of_head(into: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def _fails(copy: Path, mutant: Mutant) -> tuple[bool, float]:
    env = {**os.environ, "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/mutants",
           "REDIS_URL": "redis://127.0.0.1:6379/13", "PYTHONPATH": str(copy)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests],
                          cwd=copy, env=env, capture_output=True, text=True)
    return done.returncode != 0, time.monotonic() - started


def main(names: list[str]) -> int:
    chosen = [m for m in MUTANTS if not names or m.name in names]
    survived = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as folder:
        copy = Path(folder)
        _copy_of_head(copy)
        for mutant in chosen:
            path = copy / mutant.path
            text = path.read_text()
            if text.count(mutant.original) != 1:
                print(f"STALE   {mutant.name}: the line to break is not in {mutant.path} exactly once")
                survived.append(mutant)
                continue
            path.write_text(text.replace(mutant.original, mutant.broken))
            try:
                failed, seconds = _fails(copy, mutant)
            finally:
                path.write_text(text)
            print(f"{'caught ' if failed else 'MISSED '} {mutant.name} ({seconds:.0f} s)")
            if not failed:
                survived.append(mutant)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} broken builds caught by their tests")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
