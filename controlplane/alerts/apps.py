from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "controlplane.alerts"
    label = "alerts"
