"""The rate book: which rate of a price plan is in effect at a moment, and what an image
costs under it. The one place the rate in effect is looked up, used by the gateway (is a
tier priced?), ingest (the cost of each request), rollups and exports (the cost of each
image), estimates and previews, and the benches.

A book reads a plan's rates once, the first time the plan is asked about (or all the plans
asked for at once, with `load`), and remembers each image price it computes: a month of
images has few distinct (rate, tokens, cached tokens) triples. Usage is priced once, when it
is stored, at the rate in effect then; the event names that rate, and every report after
prices its images by that rate (`image_price`), never by looking the moment up again. A book is a snapshot: make a
new one for each unit of work (a request batch, an export, a rollup run), so that a rate
added meanwhile is seen by the next.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from decimal import Decimal

from controlplane.catalog.models import PriceRate
from controlplane.metering.rating import Rates, Usage, image_price, price


class NoRate(LookupError):
    """The plan has no rate in effect at that moment."""


class RateBook:
    def __init__(self):
        self._plans: dict[int, list] = {}  # plan id -> its PriceRate rows, latest first
        self._by_id: dict[int, object] = {}  # PriceRate id -> the row
        self._rates: dict[int, Rates] = {}  # PriceRate id -> its Rates
        self._images: dict[tuple[int, int, int], Decimal] = {}
        self._parts: dict[tuple[int, str, int], Decimal] = {}  # (rate id, text or output, tokens)

    def load(self, plan_ids: Iterable[int]) -> RateBook:
        """Read the rates of these plans (those not read yet) in one query."""
        wanted = set(plan_ids) - set(self._plans)
        if wanted:
            for plan_id in wanted:
                self._plans[plan_id] = []
            for rate in PriceRate.objects.filter(plan_id__in=wanted).select_related("plan") \
                    .order_by("-effective_from"):
                self._plans[rate.plan_id].append(rate)
                self._by_id[rate.pk] = rate
        return self

    def rate(self, rate_id: int):
        """The PriceRate with this id (its plan's rates read with it)."""
        if rate_id not in self._by_id:
            self.load([PriceRate.objects.values_list("plan_id", flat=True).get(pk=rate_id)])
        return self._by_id[rate_id]

    def rates(self, rate_id: int) -> Rates:
        """The amounts of the rate with this id."""
        if rate_id not in self._rates:
            self._rates[rate_id] = Rates.of(self.rate(rate_id))
        return self._rates[rate_id]

    def rate_at(self, plan_id: int, when: dt.datetime):
        """The PriceRate in effect for the plan at `when`; NoRate if there is none."""
        if plan_id not in self._plans:
            self.load([plan_id])
        for rate in self._plans[plan_id]:
            if rate.effective_from <= when:
                return rate
        raise NoRate(f"price plan {plan_id} has no rate in effect at {when:%Y-%m-%d %H:%M:%S %Z}")

    def rates_at(self, plan_id: int, when: dt.datetime) -> Rates:
        return self.rates(self.rate_at(plan_id, when).pk)

    def priced(self, plan_id: int, when: dt.datetime) -> bool:
        try:
            self.rate_at(plan_id, when)
        except NoRate:
            return False
        return True

    def image_price(self, rate_id: int | None, tokens: int, cached_tokens: int) -> Decimal | None:
        """One image's price at the rate that priced its request, as the per-image report prints
        it; None for an image no rate priced."""
        if rate_id is None:
            return None
        key = (rate_id, tokens, cached_tokens)
        if key not in self._images:
            self._images[key] = image_price(tokens, cached_tokens, self.rates(rate_id))
        return self._images[key]

    def request_price(self, rate_id: int, images: list[tuple[int, int]], *, text_tokens: int,
                      output_tokens: int, unlined: tuple[int, int] = (0, 0)) -> Decimal:
        """What `rating.price_parts(...).total` gives at this rate, each part priced by
        `rating` once and remembered: the ingest prices thousands of requests a second, with
        few distinct image, text and output counts among them. (The parts are whole
        micro-units, so their sum is exact in any order.)"""
        total = self._part(rate_id, "text_tokens", text_tokens) + self._part(rate_id, "output_tokens", output_tokens)
        for tokens, cached in images:
            total += self.image_price(rate_id, tokens, cached)
        if unlined[0]:
            total += price(Usage(image_tokens=unlined[0], cached_image_tokens=unlined[1]), self.rates(rate_id))
        return total

    def _part(self, rate_id: int, kind: str, tokens: int) -> Decimal:
        key = (rate_id, kind, tokens)
        if key not in self._parts:
            self._parts[key] = price(Usage(**{kind: tokens}), self.rates(rate_id))
        return self._parts[key]

