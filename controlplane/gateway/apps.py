from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "controlplane.gateway"
    label = "gateway"
