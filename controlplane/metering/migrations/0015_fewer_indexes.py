# Usage events and images are written tens of thousands a second: indexes nothing reads go.
# The request id stays unique (a constraint, which PostgreSQL backs with one index instead of
# a unique field's two); a tenant's and a tier's events are found by the request log's indexes
# that lead with them; an image's fingerprint is matched in the gateway, never queried.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('catalog', '0008_plan_currencies'),
        ('fleet', '0004_node_transformers_version'),
        ('metering', '0014_unbilled_requests'),
        ('tenants', '0006_key_requests_per_minute'),
    ]

    operations = [
        migrations.AddConstraint(
            model_name='usageevent',
            constraint=models.UniqueConstraint(fields=('request_id',), name='one_event_per_request'),
        ),
        migrations.AlterField(
            model_name='usageevent',
            name='request_id',
            field=models.CharField(max_length=64),
        ),
        migrations.AlterField(
            model_name='usageevent',
            name='tenant',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='usage_events', to='tenants.tenant'),
        ),
        migrations.AlterField(
            model_name='usageevent',
            name='tier',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='usage_events', to='catalog.modeltier'),
        ),
        migrations.AlterField(
            model_name='usageimage',
            name='fingerprint',
            field=models.CharField(max_length=32),
        ),
    ]
