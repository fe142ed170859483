from django.apps import AppConfig
from django.db.models.signals import post_migrate, pre_migrate

from controlplane.metering import immutability


class MeteringConfig(AppConfig):
    name = "controlplane.metering"
    label = "metering"

    def ready(self):
        # SQLite rebuilds a table to alter it, which a trigger naming that table would stop:
        # there the trigger is taken down before migrating and put back after.
        pre_migrate.connect(immutability.before_migrate, sender=self)
        post_migrate.connect(immutability.after_migrate, sender=self)
