"""The soak's own work failing (a sample, an ingest, a client's loop) is reported, never left
to give partial figures that look whole."""

from __future__ import annotations

import threading

import pytest

from bench import soak


def _failing_at(*failures: Exception | None):
    """Work that raises each of `failures` in turn (None: succeeds), then succeeds."""
    turns = iter(failures)

    def work() -> int:
        failure = next(turns, None)
        if failure is not None:
            raise failure
        return 0

    return work


def test_a_failing_sample_is_logged_once_counted_and_sampling_goes_on(capsys):
    failures = soak.Failures()
    work = _failing_at(OSError("the gateway is gone"), None, OSError("the gateway is gone"))
    for _ in range(3):
        failures.attempt("sampling", work)
    assert failures.counts == {"sampling": 2}
    logged = capsys.readouterr().err
    assert logged.count("sampling failed") == 1 and "OSError: the gateway is gone" in logged


def test_ingesting_goes_on_after_a_failure_and_counts_it(monkeypatch):
    from controlplane.metering import outbox

    stop, failures, calls = threading.Event(), soak.Failures(), []
    fail_first = _failing_at(ConnectionError("Redis went away"))

    def usage_ingest() -> int:
        calls.append(1)
        if len(calls) >= 2:
            stop.set()
        return fail_first()

    monkeypatch.setattr(outbox, "usage_ingest", usage_ingest)
    soak._ingest_every(0.01, stop, failures)
    assert len(calls) >= 2 and failures.counts == {"ingesting usage": 1}


def test_a_soak_whose_own_work_failed_exits_with_a_failure(monkeypatch):
    monkeypatch.setattr(soak.signal, "signal", lambda *args: None)  # pytest's own handlers stay
    monkeypatch.setattr(soak, "run", lambda *args: {"failures": {"sampling": 2}})
    with pytest.raises(SystemExit) as exited:
        soak.main(["--minutes", "1"])
    assert exited.value.code == 1
    monkeypatch.setattr(soak, "run", lambda *args: {"failures": {}})
    with pytest.raises(SystemExit) as exited:
        soak.main(["--minutes", "1"])
    assert exited.value.code == 0
