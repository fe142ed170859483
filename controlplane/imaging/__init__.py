"""Image intake, resolution policy and token economics. Pure Python: no Django, no Celery."""
