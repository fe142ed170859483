from django.apps import AppConfig


class BenchmarksConfig(AppConfig):
    name = "controlplane.benchmarks"
    label = "benchmarks"

    def ready(self):
        # Runs are queued from web requests: the web process must send them through the
        # project's Celery app (its broker), not Celery's default app (amqp://localhost).
        import workers.celery  # noqa: F401
