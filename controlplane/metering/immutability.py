"""A price rate that priced a usage event never changes: the database refuses it, whatever
writes to it (the models refuse it first; see catalog.models.PriceRate).

On PostgreSQL a trigger function (migration 0013) refuses an update of a rate's amounts, date
or plan once an event names it; the events' foreign key refuses its delete. On SQLite the same
trigger is kept here: made after every migration and dropped before the next, because SQLite
alters a table by building a new one and renaming it, which fails while a trigger names it.
"""

from __future__ import annotations

from django.db import connections

AMOUNTS = ("plan_id", "effective_from", "text_input_per_mtok", "image_per_mtok", "output_per_mtok", "per_image_fee",
           "cached_image_discount")
SQLITE = f"""
CREATE TRIGGER IF NOT EXISTS billed_rate_is_immutable BEFORE UPDATE ON catalog_pricerate FOR EACH ROW
WHEN ({' OR '.join(f'NEW.{c} IS NOT OLD.{c}' for c in AMOUNTS)})
     AND EXISTS (SELECT 1 FROM metering_usageevent WHERE rate_id = OLD.id)
BEGIN
    SELECT RAISE(ABORT, 'price rate has priced requests and cannot change: add a new rate');
END;
"""
SQLITE_DROP = "DROP TRIGGER IF EXISTS billed_rate_is_immutable;"


def before_migrate(sender, using="default", **kwargs) -> None:
    connection = connections[using]
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute(SQLITE_DROP)


def after_migrate(sender, using="default", **kwargs) -> None:
    connection = connections[using]
    if connection.vendor != "sqlite":
        return
    tables = connection.introspection.table_names()
    if "metering_usageevent" in tables and "catalog_pricerate" in tables:
        with connection.cursor() as cursor:
            cursor.execute(SQLITE)
