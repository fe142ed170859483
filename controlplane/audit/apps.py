from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "controlplane.audit"
    label = "audit"
