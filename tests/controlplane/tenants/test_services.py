"""API keys: only a hash is kept, and only usable keys authenticate."""

import datetime as dt
import hashlib
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import api_key_create, api_key_lookup, api_key_revoke

pytestmark = pytest.mark.django_db


def _every_text_value_in_the_database():
    """Every value of every column of every table, as text."""
    values = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f'SELECT * FROM "{table}"')
            for row in cursor.fetchall():
                values += [str(v) for v in row if v is not None]
    return values


def test_api_key_create_stores_only_a_sha256_and_a_prefix(world):
    issued = api_key_create(tenant=world.alice, name="ci")
    secret = issued.secret
    stored = ApiKey.objects.get(pk=issued.api_key.pk)

    assert secret.startswith("vlm-")
    assert stored.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret.startswith(f"vlm-{stored.prefix}-")
    assert len(stored.prefix) == 8
    assert (stored.tenant_id, stored.name) == (world.alice.pk, "ci")

    random_part = secret.split("-", 2)[2]
    assert len(random_part) >= 40
    everything = _every_text_value_in_the_database()
    assert not any(secret in value for value in everything)
    assert not any(random_part in value for value in everything)


def test_two_keys_for_the_same_tenant_differ(world):
    one = api_key_create(tenant=world.alice)
    two = api_key_create(tenant=world.alice)
    assert one.secret != two.secret
    assert one.api_key.prefix != two.api_key.prefix


def test_lookup_finds_the_key_and_its_tenant(world):
    issued = api_key_create(tenant=world.bob)
    found = api_key_lookup(issued.secret)
    assert found is not None
    assert found.pk == issued.api_key.pk
    assert found.tenant.name == "bob"
    assert api_key_lookup(world.alice_key).tenant.name == "alice"


def test_revoked_key_does_not_authenticate(world):
    issued = api_key_create(tenant=world.alice)
    api_key_revoke(api_key=issued.api_key)
    assert ApiKey.objects.get(pk=issued.api_key.pk).revoked_at is not None
    assert api_key_lookup(issued.secret) is None


def test_revoking_twice_keeps_the_first_revocation_time(world):
    issued = api_key_create(tenant=world.alice)
    api_key_revoke(api_key=issued.api_key)
    first = ApiKey.objects.get(pk=issued.api_key.pk).revoked_at
    api_key_revoke(api_key=ApiKey.objects.get(pk=issued.api_key.pk))
    assert ApiKey.objects.get(pk=issued.api_key.pk).revoked_at == first


def test_expired_key_does_not_authenticate(world):
    expired = api_key_create(tenant=world.alice, expires_at=timezone.now() - dt.timedelta(seconds=1))
    valid = api_key_create(tenant=world.alice, expires_at=timezone.now() + dt.timedelta(days=1))
    assert api_key_lookup(expired.secret) is None
    assert api_key_lookup(valid.secret) is not None


def test_keys_of_an_inactive_tenant_do_not_authenticate(world):
    world.charlie.active = False
    world.charlie.save()
    assert api_key_lookup(world.charlie_key) is None
    assert api_key_lookup(world.alice_key) is not None


@pytest.mark.parametrize("garbage", [
    "",
    "vlm-",
    "not-a-key",
    "Bearer vlm-abc",
    "vlm-deadbeef-" + "A" * 43,
    "vlm-" + "x" * 300,
    "\x00\xff",
])
def test_wrong_or_garbage_keys_do_not_authenticate(world, garbage):
    assert api_key_lookup(garbage) is None


def test_a_key_with_one_character_changed_does_not_authenticate(world):
    secret = world.alice_key
    tampered = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    assert api_key_lookup(tampered) is None
    assert api_key_lookup(secret + " ") is None


# --- manage.py create_api_key ------------------------------------------------------------


def test_create_api_key_command_prints_exactly_the_key(world):
    out = StringIO()
    call_command("create_api_key", "--tenant", "alice", "--name", "deploy", stdout=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    secret = lines[0]
    assert out.getvalue() == secret + "\n"
    found = api_key_lookup(secret)
    assert found is not None
    assert (found.tenant.name, found.name) == ("alice", "deploy")


def test_create_api_key_command_refuses_an_unknown_tenant(world):
    before = ApiKey.objects.count()
    with pytest.raises(CommandError, match="no tenant named 'mallory'"):
        call_command("create_api_key", tenant="mallory", stdout=StringIO())
    assert ApiKey.objects.count() == before


def test_a_key_prefix_collision_is_retried_not_a_failure(world, monkeypatch):
    from controlplane.tenants import services

    taken = world.alice.api_keys.first().prefix
    prefixes = iter([taken, taken, "0badcafe"])
    monkeypatch.setattr(services.secrets, "token_hex", lambda n: next(prefixes))
    issued = services.api_key_create(tenant=world.bob)
    assert issued.api_key.prefix == "0badcafe"
    assert services.api_key_lookup(issued.secret).tenant == world.bob


def test_no_key_is_made_for_an_inactive_tenant(world):
    from controlplane.tenants.services import TenantInactive

    world.charlie.active = False
    world.charlie.save()
    with pytest.raises(TenantInactive, match="charlie is deactivated"):
        api_key_create(tenant=world.charlie, name="meanwhile")
    world.charlie.active = True
    world.charlie.save()
    assert not ApiKey.objects.filter(name="meanwhile").exists()


def test_a_key_is_not_made_for_a_tenant_deactivated_since_it_was_read(world):
    from controlplane.tenants.models import Tenant
    from controlplane.tenants.services import TenantInactive

    stale = Tenant.objects.get(pk=world.charlie.pk)
    Tenant.objects.filter(pk=world.charlie.pk).update(active=False)
    with pytest.raises(TenantInactive):
        api_key_create(tenant=stale, name="stale")
    assert not ApiKey.objects.filter(name="stale").exists()


def test_create_api_key_command_refuses_an_inactive_tenant(world):
    world.charlie.active = False
    world.charlie.save()
    with pytest.raises(CommandError, match="charlie is deactivated"):
        call_command("create_api_key", "--tenant", "charlie", stdout=StringIO())


def test_reactivating_a_tenant_revokes_the_keys_made_while_it_was_deactivated(world):
    from controlplane.tenants.services import key_hash, tenant_save

    before = api_key_lookup(world.charlie_key).pk
    world.charlie.active = False
    tenant_save(tenant=world.charlie, tiers=None, quota=None, actor="olivia")
    # As a key was made before api_key_create checked: nothing makes one now.
    meanwhile = ApiKey.objects.create(tenant=world.charlie, prefix="meanwhil", key_hash=key_hash("vlm-meanwhile"))
    world.charlie.active = True
    tenant_save(tenant=world.charlie, tiers=None, quota=None, actor="olivia")
    meanwhile.refresh_from_db()
    assert meanwhile.revoked_at is not None
    assert api_key_lookup(world.charlie_key).pk == before
