"""Billing and quota periods, in UTC: a quota's day or month, its minute, a statement's month.
Pure Python: no Django, no Celery."""

from __future__ import annotations

import calendar
import datetime as dt
import re


def period_window(period: str, now: dt.datetime) -> str:
    """The name of the day (YYYYMMDD) or month (YYYYMM) `now` falls in."""
    return now.strftime("%Y%m%d") if period == "day" else now.strftime("%Y%m")


def period_start(period: str, now: dt.datetime) -> dt.datetime:
    start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return start if period == "day" else start.replace(day=1)


def seconds_to_period_end(period: str, now: dt.datetime) -> int:
    """Whole seconds until the period ends, rounded up (what Retry-After says)."""
    start = period_start(period, now)
    if period == "day":
        end = start + dt.timedelta(days=1)
    else:
        end = start + dt.timedelta(days=calendar.monthrange(start.year, start.month)[1])
    return int((end - now).total_seconds()) + 1


def minute_window(now: dt.datetime) -> str:
    return now.strftime("%Y%m%d%H%M")


def month_bounds(year: int, month: int) -> tuple[dt.datetime, dt.datetime]:
    """A calendar month as [start, end) in UTC."""
    start = dt.datetime(year, month, 1, tzinfo=dt.UTC)
    return start, start + dt.timedelta(days=calendar.monthrange(year, month)[1])


_MONTH = re.compile(r"([0-9]{4})-([0-9]{2})", re.ASCII)


def month_of(text: str) -> tuple[int, int]:
    """(year, month) of a YYYY-MM a user typed; ValueError saying why not."""
    found = _MONTH.fullmatch(text or "")
    year, month = (int(found[1]), int(found[2])) if found else (0, 0)
    if not found or not 1 <= month <= 12 or not 1 <= year or (year, month) == (9999, 12):
        raise ValueError("use YYYY-MM, a month from 0001-01 to 9999-11")
    return year, month
