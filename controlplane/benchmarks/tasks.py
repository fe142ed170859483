"""Benchmark tasks. Thin: ids in, a service call out; limits declared here."""

from __future__ import annotations

from celery import shared_task

from controlplane.benchmarks.evalsets import evalset_import_execute
from controlplane.benchmarks.gates import check_execute
from controlplane.benchmarks.services import benchmark_execute, benchmark_start_scheduled


@shared_task(name="benchmarks.run", bind=True, soft_time_limit=3600, time_limit=3700)
def benchmark_run(self, run_id: int | None = None, profile_id: int | None = None) -> None:
    """A run by id (started on demand), or a new run of a profile (its schedule's turn)."""
    if run_id is None:
        run = benchmark_start_scheduled(profile_id=profile_id, task_id=self.request.id or "")
        if run is None:
            return
        run_id = run.pk
    benchmark_execute(run_id=run_id)


@shared_task(name="benchmarks.evalset_import", soft_time_limit=3600, time_limit=3700)
def evalset_import(import_id: int) -> None:
    """Read, check and save an uploaded evaluation set; its import row shows the progress."""
    evalset_import_execute(import_id=import_id)


@shared_task(name="benchmarks.gate_check", soft_time_limit=1800, time_limit=1900)
def gate_check_run(check_id: int) -> None:
    """Measure a proposed change on its gated tiers; while its candidate engine starts, look
    again a little later (the worker is not held meanwhile)."""
    again = check_execute(check_id=check_id)
    if again is not None:
        gate_check_run.apply_async(args=[check_id], countdown=again)
