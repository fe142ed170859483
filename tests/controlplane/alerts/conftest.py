import datetime as dt
import itertools

import pytest
from django.utils import timezone

from controlplane.alerts.models import AlertRule
from controlplane.metering.models import UsageEvent
from tests.factories import AlertRuleFactory
from tests.webhooks import webhook_receiver

_ids = itertools.count()


@pytest.fixture
def receiver(settings):
    # The receiver listens on 127.0.0.1: trusted, as an operator trusts a receiver of their own.
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]
    with webhook_receiver() as running:
        yield running


@pytest.fixture
def only_rule(db):
    """Replace the default rules with one rule: what a test evaluates is that rule alone."""
    def make(**fields):
        AlertRule.objects.all().delete()
        return AlertRuleFactory(**fields)
    return make


@pytest.fixture
def now():
    return timezone.now()


def usage(*, tenant, tier, n=1, at=None, **fields) -> None:
    """`n` usage events as the gateway records them (only the fields a rule reads)."""
    status = fields.pop("status", "ok")
    UsageEvent.objects.bulk_create(
        UsageEvent(request_id=f"req_alert_{next(_ids)}", tenant=tenant, tier=tier, status=status,
                   created_at=at or timezone.now(), **fields) for _ in range(n))


def later(now, **delta):
    return now + dt.timedelta(**delta)
