# Each usage event names the rate that priced it; the rate then never changes (the database
# refuses an update of a rate some event names, and its foreign key a delete; on SQLite the
# trigger is made after migrating, see controlplane/metering/immutability.py).

import django.db.models.deletion
from django.db import migrations, models

_AMOUNTS = ("plan_id", "effective_from", "text_input_per_mtok", "image_per_mtok", "output_per_mtok", "per_image_fee",
            "cached_image_discount")

# Events stored before this named no rate: the rate of their tier's plan in effect when each was
# made is the one that priced it (prices were never edited after billing once checks existed).
BACKFILL = """
UPDATE metering_usageevent SET rate_id = (
    SELECT r.id FROM catalog_pricerate r JOIN catalog_modeltier t ON t.price_plan_id = r.plan_id
    WHERE t.id = metering_usageevent.tier_id AND r.effective_from <= metering_usageevent.created_at
    ORDER BY r.effective_from DESC LIMIT 1)
WHERE rated AND (status = 'ok' OR (status IN ('aborted', 'interrupted') AND instance_id IS NOT NULL))
"""

POSTGRESQL = f"""
CREATE FUNCTION refuse_rewriting_a_billed_rate() RETURNS trigger AS $$
BEGIN
    IF ({', '.join('NEW.' + c for c in _AMOUNTS)}) IS DISTINCT FROM ({', '.join('OLD.' + c for c in _AMOUNTS)})
       AND EXISTS (SELECT 1 FROM metering_usageevent WHERE rate_id = OLD.id) THEN
        RAISE EXCEPTION 'price rate % has priced requests and cannot change: add a new rate', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER billed_rate_is_immutable BEFORE UPDATE ON catalog_pricerate
    FOR EACH ROW EXECUTE FUNCTION refuse_rewriting_a_billed_rate();
"""
POSTGRESQL_UNDO = """
DROP TRIGGER IF EXISTS billed_rate_is_immutable ON catalog_pricerate;
DROP FUNCTION IF EXISTS refuse_rewriting_a_billed_rate();
"""
def _trigger(apps, schema_editor):
    # On SQLite the trigger is made after migrating (controlplane/metering/immutability.py).
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRESQL, params=None)


def _no_trigger(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRESQL_UNDO, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ('catalog', '0008_plan_currencies'),
        ('fleet', '0004_node_transformers_version'),
        ('metering', '0012_request_log'),
        ('tenants', '0006_key_requests_per_minute'),
    ]

    operations = [
        migrations.AddField(
            model_name='usageevent',
            name='rate',
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='usage_events', to='catalog.pricerate'),
        ),
        migrations.AddIndex(
            model_name='usageevent',
            index=models.Index(fields=['rate', 'created_at'], name='usage_by_rate'),
        ),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.RunPython(_trigger, _no_trigger),
    ]
