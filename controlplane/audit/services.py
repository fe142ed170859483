"""Recording changes. Called in the same transaction as the change it records, so an entry
exists exactly when the change does."""

from __future__ import annotations

from decimal import Decimal

from django.db import models
from django.db.models import F, Window
from django.db.models.functions import RowNumber

from controlplane.audit.models import AuditEntry

SYSTEM = "system"


def _plain(value):
    if isinstance(value, Decimal):  # 0.45 and 0.450000 are one price
        return f"{value.normalize():f}"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def field_values(obj: models.Model, fields: tuple[str, ...]) -> dict:
    return {name: _plain(getattr(obj, name)) for name in fields}


def audit_record(*, actor: str, action: str, obj: models.Model, before: dict | None = None,
                 after: dict | None = None) -> AuditEntry | None:
    """Record a change of `obj`: `before` and `after` as from field_values (either empty for
    a creation or a deletion). A change that changes nothing is not recorded."""
    before, after = before or {}, after or {}
    changes = {name: [before.get(name), after.get(name)] for name in sorted(set(before) | set(after))
               if before.get(name) != after.get(name)}
    if action == AuditEntry.Action.CHANGED and not changes:
        return None
    return AuditEntry.objects.create(actor=actor or SYSTEM, action=action, object_type=obj._meta.verbose_name,
                                     object_id=str(obj.pk), object_repr=str(obj)[:255], changes=changes)


def history(obj: models.Model):
    """The entries of one object, newest first."""
    return AuditEntry.objects.filter(object_type=obj._meta.verbose_name, object_id=str(obj.pk))


def histories(objects: list[models.Model], *, each: int):
    """The entries of several objects of one model, newest first, at most `each` of any one
    of them: one query however many objects there are."""
    if not objects:
        return AuditEntry.objects.none()
    nth = Window(RowNumber(), partition_by=F("object_id"), order_by=(F("at").desc(), F("id").desc()))
    return (AuditEntry.objects.filter(object_type=objects[0]._meta.verbose_name,
                                      object_id__in=[str(obj.pk) for obj in objects])
            .annotate(nth=nth).filter(nth__lte=each))
