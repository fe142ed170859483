"""Price maths. One function prices usage for gateway estimates, rollups and exports.

Rounding rule: a request's cost is computed exactly in Decimal, then rounded half-even to
1e-6 of the currency (a micro-unit). Totals are sums of those rounded request costs, so a
statement always equals the sum of its lines. Pure Python: no Django, no Celery.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

MICRO = Decimal("0.000001")
MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class Rates:
    text_input_per_mtok: Decimal
    image_per_mtok: Decimal
    output_per_mtok: Decimal
    per_image_fee: Decimal = Decimal("0")
    cached_image_discount: Decimal = Decimal("0")


@dataclass(frozen=True)
class Usage:
    text_tokens: int = 0
    image_tokens: int = 0
    cached_image_tokens: int = 0
    output_tokens: int = 0
    images: int = 0


def price(usage: Usage, rates: Rates) -> Decimal:
    if usage.cached_image_tokens > usage.image_tokens:
        raise ValueError("cached image tokens cannot exceed image tokens")
    billable_image = Decimal(usage.image_tokens) - Decimal(usage.cached_image_tokens) * (
        rates.cached_image_discount
    )
    cost = (
        Decimal(usage.text_tokens) * rates.text_input_per_mtok
        + billable_image * rates.image_per_mtok
        + Decimal(usage.output_tokens) * rates.output_per_mtok
    ) / MILLION + Decimal(usage.images) * rates.per_image_fee
    return cost.quantize(MICRO, rounding=ROUND_HALF_EVEN)
