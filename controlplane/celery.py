"""The Celery app. Every host runs a worker; a GPU host's worker also consumes `node.<name>`.

Each app keeps its tasks in its own `tasks.py` (fleet, metering, benchmarks, alerts), found here by
autodiscovery over the installed apps.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
