from decimal import Decimal

import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from controlplane.catalog.models import ModelTier, PricePlan, PriceRate, ResolutionPolicy
from controlplane.demo import PRICES_FROM
from controlplane.tenants.models import Membership, Tenant


class ResolutionPolicyFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ResolutionPolicy
        django_get_or_create = ["name"]

    name = "standard"
    max_pixels = 1003520
    low_detail_max_pixels = 200704


class PricePlanFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = PricePlan
        django_get_or_create = ["name"]
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"plan-{n}")

    @factory.post_generation
    def rate(plan, create, extracted, **kwargs):
        if create:
            PriceRate.objects.get_or_create(plan=plan, effective_from=PRICES_FROM, defaults={
                "text_input_per_mtok": Decimal("0.20"), "image_per_mtok": Decimal("0.30"),
                "output_per_mtok": Decimal("0.60"), "per_image_fee": Decimal("0.001"),
                "cached_image_discount": Decimal("0.5"),
            })


class VisionTierFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ModelTier
        django_get_or_create = ["name"]

    name = "vlm-lite"
    family = "qwen2_5_vl"
    model_id = "Qwen/Qwen2.5-VL-3B-Instruct"
    kind = ModelTier.Kind.VISION
    engine_kind = ModelTier.EngineKind.SIMULATOR
    engine_settings = factory.LazyFunction(lambda: {"max_model_len": 32768, "max_num_seqs": 16,
                                                    "max_output_tokens": 1024})
    resolution_policy = factory.SubFactory(ResolutionPolicyFactory)
    price_plan = factory.SubFactory(PricePlanFactory, name="vlm-lite")


class TextTierFactory(VisionTierFactory):
    name = "text"
    family = "qwen2"
    model_id = "Qwen/Qwen2.5-7B-Instruct"
    kind = ModelTier.Kind.TEXT
    resolution_policy = None
    price_plan = factory.SubFactory(PricePlanFactory, name="text")


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant
        django_get_or_create = ["name"]

    name = factory.Sequence(lambda n: f"tenant-{n}")


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ["username"]
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user-{n}")

    @factory.post_generation
    def password(user, create, extracted, **kwargs):
        user.set_password(extracted or "password")
        if create:
            user.save(update_fields=["password"])


def make_operator(username="olivia"):
    user = UserFactory(username=username)
    user.groups.add(Group.objects.get_or_create(name="operator")[0])
    return user


def make_finance(username="fiona"):
    user = UserFactory(username=username)
    user.groups.add(Group.objects.get_or_create(name="finance")[0])
    return user


def make_tenant_admin(tenant, username):
    user = UserFactory(username=username)
    Membership.objects.create(user=user, tenant=tenant)
    return user


class AlertRuleFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = "alerts.AlertRule"

    name = factory.Sequence(lambda n: f"rule-{n}")
    kind = "quota_use"
    threshold = Decimal(80)


class WebhookFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = "alerts.Webhook"

    name = factory.Sequence(lambda n: f"hook-{n}")
    url = "http://127.0.0.1:9/hooks/none"
