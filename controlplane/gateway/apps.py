import threading

from django.apps import AppConfig, apps


class GatewayConfig(AppConfig):
    name = "controlplane.gateway"
    label = "gateway"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.process = None  # built on first use: most commands never serve a request
        self.building = threading.Lock()


def current_process():
    """The state this gateway process holds while it serves (process.GatewayProcess)."""
    config = apps.get_app_config("gateway")
    if config.process is None:
        with config.building:
            if config.process is None:
                # It imports models, which cannot load while this module loads: apps are not ready yet.
                from controlplane.gateway.process import GatewayProcess

                config.process = GatewayProcess.from_settings()
    return config.process
