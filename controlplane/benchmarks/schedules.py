"""A profile's schedule as a django-celery-beat PeriodicTask, kept in step with the profile.

Beat reads PeriodicTask rows (CELERY_BEAT_SCHEDULER is the database scheduler), so saving a
profile is all it takes for a new or changed schedule to be picked up.
"""

from __future__ import annotations

import json

from django.core.exceptions import ValidationError
from django.db import transaction
from django_celery_beat.models import CrontabSchedule, PeriodicTask
from django_celery_beat.validators import crontab_validator

TASK_NAME = "benchmarks.run"


def parse_cron(expression: str) -> dict:
    """Five cron fields as CrontabSchedule's keyword arguments; ValueError if malformed."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError("five fields: minute hour day-of-month month day-of-week")
    try:
        crontab_validator(" ".join(fields))
    except ValidationError as exc:
        raise ValueError("; ".join(exc.messages)) from None
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    return {"minute": minute, "hour": hour, "day_of_month": day_of_month,
            "month_of_year": month_of_year, "day_of_week": day_of_week}


def periodic_task_name(profile) -> str:
    return f"benchmark profile {profile.pk}: {profile.name}"


@transaction.atomic
def profile_schedule_sync(*, profile) -> None:
    """Create, change, pause or remove the profile's PeriodicTask to match its fields."""
    task = profile.periodic_task
    if not profile.schedule_cron:
        if task is not None:
            profile.periodic_task = None
            profile.save(update_fields=["periodic_task"])
            task.delete()
        return
    crontab, _ = CrontabSchedule.objects.get_or_create(**parse_cron(profile.schedule_cron), timezone="UTC")
    fields = {
        "name": periodic_task_name(profile), "task": TASK_NAME, "crontab": crontab, "interval": None,
        "kwargs": json.dumps({"profile_id": profile.pk}), "args": "[]",
        "enabled": profile.schedule_enabled,
        "description": f"Benchmark profile {profile.name}",
    }
    if task is None:
        task = PeriodicTask.objects.create(**fields)
        profile.periodic_task = task
        profile.save(update_fields=["periodic_task"])
    else:
        for name, value in fields.items():
            setattr(task, name, value)
        task.save()


def profile_schedule_remove(*, profile) -> None:
    if profile.periodic_task is not None:
        profile.periodic_task.delete()
