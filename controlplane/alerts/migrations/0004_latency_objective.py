"""A rule kind for a request class whose first token comes later than its tier's objective, and
a default rule of that kind."""

from decimal import Decimal

from django.db import migrations, models

# Fires for a tier's request class whose time to first token at p95 passes the objective the
# tier sets for it, over 15 minutes with at least 20 requests; quiet for tiers that set none.
DEFAULT_RULE = {"name": "First token past its objective", "kind": "latency_objective", "threshold": Decimal(100),
                "window_minutes": 15, "min_requests": 20}


def create(apps, schema_editor):
    AlertRule = apps.get_model("alerts", "AlertRule")
    AlertRule.objects.get_or_create(name=DEFAULT_RULE["name"], defaults=DEFAULT_RULE)


def remove(apps, schema_editor):
    AlertRule = apps.get_model("alerts", "AlertRule")
    AlertRule.objects.filter(name=DEFAULT_RULE["name"], alerts__isnull=True).delete()


class Migration(migrations.Migration):

    dependencies = [
        ('alerts', '0003_quality_regression'),
    ]

    operations = [
        migrations.AlterField(
            model_name='alertrule',
            name='kind',
            field=models.CharField(choices=[('quota_use', "a tenant's quota use"), ('engine_unhealthy', 'an engine crash-looping or down'), ('unrated_usage', 'usage stored without a rate'), ('error_rate', "a tier's error rate"), ('count_disagree', "the engine's image tokens disagree with the gateway's"), ('quality_regression', "a tier's accuracy falling between two resolution sweeps"), ('latency_objective', "a request class's first token past its tier's objective")], max_length=32),
        ),
        migrations.RunPython(create, remove),
    ]
