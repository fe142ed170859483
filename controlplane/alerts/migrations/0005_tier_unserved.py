"""A rule kind for an enabled tier that no engine serves (its requests are answered 503),
and a default rule of that kind."""

from decimal import Decimal

from django.db import migrations, models

RULE = {"name": "Tier with no engine serving", "kind": "tier_unserved", "threshold": Decimal(120)}


def create(apps, schema_editor):
    AlertRule = apps.get_model("alerts", "AlertRule")
    AlertRule.objects.get_or_create(name=RULE["name"], defaults=RULE)


def remove(apps, schema_editor):
    AlertRule = apps.get_model("alerts", "AlertRule")
    AlertRule.objects.filter(name=RULE["name"], alerts__isnull=True).delete()


class Migration(migrations.Migration):
    dependencies = [("alerts", "0004_latency_objective")]
    operations = [
        migrations.AlterField(
            model_name="alertrule",
            name="kind",
            field=models.CharField(choices=[
                ("quota_use", "a tenant's quota use"), ("engine_unhealthy", "an engine crash-looping or down"),
                ("unrated_usage", "usage stored without a rate"), ("error_rate", "a tier's error rate"),
                ("count_disagree", "the engine's image tokens disagree with the gateway's"),
                ("quality_regression", "a tier's accuracy falling between two resolution sweeps"),
                ("latency_objective", "a request class's first token past its tier's objective"),
                ("tier_unserved", "an enabled tier with no engine serving it")], max_length=32),
        ),
        migrations.RunPython(create, remove),
    ]
