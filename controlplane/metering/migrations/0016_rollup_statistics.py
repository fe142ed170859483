# The daily rollup groups ten million images by their request's day, tenant, tier and rate and
# by their tokens: a few thousand groups, which PostgreSQL took for as many as its rows (it
# multiplies each column's distinct values), so it gathered every row into one process to
# group them there. Statistics on how those columns vary together let it group on each
# parallel worker first. PostgreSQL only (SQLite has no such statistics, and no workers).

from django.db import migrations

STATISTICS = (
    ("usage_event_rollup_groups",
     "tenant_id, tier_id, rate_id, ((created_at AT TIME ZONE 'UTC')::date)", "metering_usageevent"),
    ("usage_image_rollup_groups", "tokens, cached_tokens", "metering_usageimage"),
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name, columns, table in STATISTICS:
            schema_editor.execute(f"CREATE STATISTICS IF NOT EXISTS {name} (ndistinct) ON {columns} FROM {table}")


def remove(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name, _, _ in STATISTICS:
            schema_editor.execute(f"DROP STATISTICS IF EXISTS {name}")


class Migration(migrations.Migration):

    dependencies = [
        ('metering', '0015_fewer_indexes'),
    ]

    operations = [migrations.RunPython(create, remove)]
