"""Price plans for operators (finance reads them): plans with their currency, each plan's
rates over time, and a new rate from a date with a preview of what it changes. A rate that has
billed anything is never edited: a change is a new rate."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from controlplane.audit.services import histories
from controlplane.catalog.forms import PricePlanForm, PriceRateForm
from controlplane.catalog.models import PricePlan, PriceRate
from controlplane.catalog.services import tier_image_tokens
from controlplane.catalog.views.preview import SAMPLE_SIZES
from controlplane.imaging.errors import ImageError
from controlplane.imaging.policy import sent_sizes
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.metering.rating import Rates, Usage, images_price, price
from controlplane.web.access import staff_only


@login_required
def plan_list(request):
    staff_only(request, change=request.method == "POST")
    form = PricePlanForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        plan = form.instance
        plan.save(actor=request.user.get_username())
        messages.success(request, f"Plan {plan.name} created: add its first rate.")
        return redirect("dashboard:price-plan", name=plan.name)
    plans = list(PricePlan.objects.prefetch_related("tiers").order_by("name"))
    now, book = timezone.now(), RateBook().load(plan.pk for plan in plans)  # every plan's rates at once
    for plan in plans:
        try:
            plan.current = book.rate_at(plan.pk, now)
        except NoRate:
            plan.current = None
    return render(request, "catalog/prices.html", {"plans": plans, "form": form})


@login_required
def plan_detail(request, name):
    staff_only(request, change=request.method == "POST")
    plan = get_object_or_404(PricePlan, name=name)
    form = PriceRateForm(request.POST or None, initial={"effective_from": timezone.now()},
                         instance=PriceRate(plan=plan, created_by=request.user.get_username()))
    preview = None
    if request.method == "POST" and form.is_valid():
        rate = form.instance
        if "save" in request.POST:
            rate.save(actor=request.user.get_username())
            messages.success(request, f"New rate of {plan.name} from {rate.effective_from:%Y-%m-%d %H:%M %Z}.")
            return redirect("dashboard:price-plan", name=plan.name)
        preview = _compare(plan, rate)
    # What each rate billed, counted as PriceRate.billed_requests counts it, for every rate at once.
    rates = list(plan.rates.annotate(billed=Count("usage_events")).order_by("-effective_from"))
    entries = list(histories(rates, each=10)[:20])
    return render(request, "catalog/price_plan.html", {"plan": plan, "rates": rates, "form": form,
                                                         "preview": preview, "history": entries})


def _compare(plan: PricePlan, rate: PriceRate) -> list[dict]:
    """What sample requests cost on each tier of `plan` now and at `rate`."""
    try:
        current = RateBook().rates_at(plan.pk, timezone.now())
    except NoRate:
        current = None
    proposed = Rates.of(rate)
    rows = []
    text = Usage(text_tokens=1_000_000)
    rows.append({"what": "1 M text input tokens", "now": price(text, current) if current else None,
                 "then": price(text, proposed)})
    output = Usage(output_tokens=1_000_000)
    rows.append({"what": "1 M output tokens", "now": price(output, current) if current else None,
                 "then": price(output, proposed)})
    for tier in plan.tiers.filter(kind="vision").select_related("resolution_policy"):
        policy = tier.image_policy()
        for width, height in SAMPLE_SIZES:
            try:
                sent = sent_sizes(width, height, policy)
            except ImageError:
                continue
            each = [tier_image_tokens(tier, w, h) for w, h in sent]
            rows.append({"what": f"{tier.name}: a {width} × {height} photo ({sum(each):,} tokens)",
                         "now": images_price(each, current) if current else None,
                         "then": images_price(each, proposed)})
    for row in rows:
        row["change"] = (row["then"] - row["now"]) if row["now"] is not None else None
    return rows


