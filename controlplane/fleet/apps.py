from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "controlplane.fleet"
    label = "fleet"

    def ready(self):
        # Every process that loads Django (web and gateway included) sends tasks through the
        # project's Celery app and its broker, not Celery's default app (amqp://localhost).
        # Not imported from controlplane/__init__.py: the pure modules under controlplane/
        # (imaging, rating, the load generator) import neither Django nor Celery.
        import controlplane.celery  # noqa: F401
