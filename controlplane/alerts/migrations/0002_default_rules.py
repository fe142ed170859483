"""The rules a fresh install alerts with, before anyone configures anything (operators change
or disable them on the Alerts page)."""

from decimal import Decimal

from django.db import migrations

DEFAULT_RULES = [
    {"name": "Quota 80 % used", "kind": "quota_use", "threshold": Decimal(80)},
    {"name": "Quota used up", "kind": "quota_use", "threshold": Decimal(100)},
    {"name": "Engine crash-looping or down", "kind": "engine_unhealthy", "threshold": Decimal(3),
     "window_minutes": 30, "for_seconds": 120},
    {"name": "Usage without a rate", "kind": "unrated_usage", "threshold": Decimal(1), "window_minutes": 60},
    {"name": "Tier error rate over 5 %", "kind": "error_rate", "threshold": Decimal(5), "window_minutes": 15,
     "min_requests": 20},
    {"name": "Image token counts disagree", "kind": "count_disagree", "threshold": Decimal(1),
     "window_minutes": 60},
]


def create(apps, schema_editor):
    AlertRule = apps.get_model("alerts", "AlertRule")
    for rule in DEFAULT_RULES:
        AlertRule.objects.get_or_create(name=rule["name"], defaults=rule)


def remove(apps, schema_editor):
    AlertRule = apps.get_model("alerts", "AlertRule")
    AlertRule.objects.filter(name__in=[rule["name"] for rule in DEFAULT_RULES], alerts__isnull=True).delete()


class Migration(migrations.Migration):
    dependencies = [("alerts", "0001_initial")]
    operations = [migrations.RunPython(create, remove)]
