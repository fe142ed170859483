from django.apps import AppConfig
from django.db.models.signals import post_migrate


class TenantsConfig(AppConfig):
    name = "controlplane.tenants"
    label = "tenants"

    def ready(self):
        # It imports models, which cannot load while this module loads: apps are not ready yet.
        from controlplane.tenants.roles import roles_sync

        # After the last app migrates, every permission exists: give the roles theirs.
        post_migrate.connect(roles_sync, dispatch_uid="tenants.roles_sync")
