"""A rule kind for accuracy that falls between two resolution sweeps of one profile, and a
default rule of that kind (a week's window: a weekly sweep's fall stays visible until the next)."""

from decimal import Decimal

from django.db import migrations, models

DEFAULT_RULE = {"name": "Accuracy fell between sweeps", "kind": "quality_regression", "threshold": Decimal(5),
                "window_minutes": 7 * 24 * 60}


def create(apps, schema_editor):
    AlertRule = apps.get_model("alerts", "AlertRule")
    AlertRule.objects.get_or_create(name=DEFAULT_RULE["name"], defaults=DEFAULT_RULE)


def remove(apps, schema_editor):
    AlertRule = apps.get_model("alerts", "AlertRule")
    AlertRule.objects.filter(name=DEFAULT_RULE["name"], alerts__isnull=True).delete()


class Migration(migrations.Migration):
    dependencies = [("alerts", "0002_default_rules")]

    operations = [
        migrations.AlterField(
            model_name="alertrule",
            name="kind",
            field=models.CharField(
                choices=[("quota_use", "a tenant's quota use"), ("engine_unhealthy", "an engine crash-looping or down"),
                         ("unrated_usage", "usage stored without a rate"), ("error_rate", "a tier's error rate"),
                         ("count_disagree", "the engine's image tokens disagree with the gateway's"),
                         ("quality_regression", "a tier's accuracy falling between two resolution sweeps")],
                max_length=32),
        ),
        migrations.RunPython(create, remove),
    ]
