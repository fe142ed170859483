from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "controlplane.metering"
    label = "metering"
