from django.core.management.base import BaseCommand, CommandError

from controlplane.tenants.models import Tenant
from controlplane.tenants.services import TenantInactive, api_key_create


class Command(BaseCommand):
    help = "Create an API key for a tenant and print it on stdout (and nothing else)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="Tenant name")
        parser.add_argument("--name", default="", help="A label for the key")

    def handle(self, *args, tenant, name, **options):
        try:
            owner = Tenant.objects.get(name=tenant)
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant named {tenant!r}") from None
        try:
            self.stdout.write(api_key_create(tenant=owner, name=name).secret)
        except TenantInactive as exc:
            raise CommandError(str(exc)) from None
