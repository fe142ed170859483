from django.conf import settings
from django.core.management.base import BaseCommand

from controlplane.demo import USERS, demo_api_key, seed_demo


class Command(BaseCommand):
    help = "Create the demo tiers, tenant and logins (idempotent) and print the demo API key."

    def handle(self, *args, **options):
        tenant = seed_demo()
        key = demo_api_key(tenant, settings.VAR_DIR / "demo_api_key")
        logins = ", ".join(f"{u}/{p}" for u, p, _ in USERS)
        self.stdout.write(f"Demo logins (user/password): {logins}")
        self.stdout.write(f"Demo tenant API key: {key}")
