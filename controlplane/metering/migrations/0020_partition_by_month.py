"""Usage events and their pictures partitioned by month on PostgreSQL (metering/partitions.py)."""

import django.db.models.deletion
from django.db import migrations, models

from controlplane.metering.partitions import TABLES, table_partition

MONTHS_AHEAD = 2


def partition(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # SQLite (embedded mode) keeps one table each
    with schema_editor.connection.cursor() as cursor:
        for table in TABLES:
            table_partition(cursor, table, months_ahead=MONTHS_AHEAD)


class Migration(migrations.Migration):

    dependencies = [
        ("metering", "0019_routing_rules"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="usageevent", name="one_event_per_request"),
        migrations.AddConstraint(
            model_name="usageevent",
            constraint=models.UniqueConstraint(fields=("request_id", "created_at"), name="one_event_per_request"),
        ),
        migrations.AlterField(
            model_name="usageimage",
            name="event",
            field=models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.CASCADE,
                                    related_name="images", to="metering.usageevent"),
        ),
        migrations.AddField(
            model_name="usageimage",
            name="created_at",
            field=models.DateTimeField(null=True, help_text="Its event's: the picture lives in its event's month"),
        ),
        migrations.RunSQL(
            "UPDATE metering_usageimage SET created_at = (SELECT e.created_at FROM metering_usageevent e "
            "WHERE e.id = metering_usageimage.event_id)",
            migrations.RunSQL.noop,
        ),
        migrations.AlterField(
            model_name="usageimage",
            name="created_at",
            field=models.DateTimeField(help_text="Its event's: the picture lives in its event's month"),
        ),
        migrations.RunPython(partition, migrations.RunPython.noop),
    ]
