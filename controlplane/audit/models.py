"""Who changed what, and when: one entry per change of a price, with each field before and after."""

from django.db import models
from django.utils import timezone


class AuditEntry(models.Model):
    class Action(models.TextChoices):
        CREATED = "created", "created"
        CHANGED = "changed", "changed"
        DELETED = "deleted", "deleted"

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=150, help_text="The user who made the change, or 'system'")
    action = models.CharField(max_length=8, choices=Action.choices)
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64)
    object_repr = models.CharField(max_length=255)
    changes = models.JSONField(default=dict, blank=True, help_text="field: [before, after]")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id", "-at"], name="audit_by_object")]

    def __str__(self):
        return f"{self.at:%Y-%m-%d %H:%M:%S %Z} {self.actor} {self.action} {self.object_type} {self.object_repr}"
