"""Price maths. One function prices usage for gateway estimates, rollups and exports.

Rounding rule: each part of a request is computed exactly in Decimal, then rounded half-even
to 1e-6 of the currency (a micro-unit): every image on its own (its tokens, less its cached
share's discount, and its fee), the text, and the output. A request's cost is the sum of its
parts, and totals are sums of request costs, so a statement equals the sum of its lines, and
the per-image report plus the text and output parts equals the statement, to the micro-unit.
Pure Python: no Django, no Celery.
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

    @classmethod
    def of(cls, rate) -> Rates:
        """The amounts of a stored price rate (a catalog PriceRate)."""
        return cls(text_input_per_mtok=rate.text_input_per_mtok, image_per_mtok=rate.image_per_mtok,
                   output_per_mtok=rate.output_per_mtok, per_image_fee=rate.per_image_fee,
                   cached_image_discount=rate.cached_image_discount)


@dataclass(frozen=True)
class Usage:
    text_tokens: int = 0
    image_tokens: int = 0
    cached_image_tokens: int = 0
    output_tokens: int = 0
    images: int = 0


@dataclass(frozen=True)
class Priced:
    images: tuple[Decimal, ...]  # one per image, fee included
    text: Decimal
    output: Decimal

    @property
    def total(self) -> Decimal:
        return sum(self.images, Decimal(0)) + self.text + self.output


def image_price(tokens: int, cached: int, rates: Rates) -> Decimal:
    """One image: its tokens less its cached share's discount, and its fee, rounded."""
    return price(Usage(image_tokens=tokens, cached_image_tokens=cached, images=1), rates)


def images_price(tokens_each: list[int], rates: Rates) -> Decimal:
    """What images cost as a request's image parts are billed: each on its own, with its fee
    (an estimate of a picture cut into tiles is priced tile by tile, as its bill will be)."""
    return sum((image_price(tokens, 0, rates) for tokens in tokens_each), Decimal(0))


def money_text(amount: Decimal) -> str:
    """An amount as reports print it: always to the micro-unit, six places."""
    return f"{amount.quantize(MICRO, rounding=ROUND_HALF_EVEN):f}"


def price_parts(*, images: list[tuple[int, int]], text_tokens: int, output_tokens: int, rates: Rates,
                unlined: tuple[int, int] = (0, 0)) -> Priced:
    """A request priced part by part: `images` as (tokens, of which cached) per image, each
    with its fee; `unlined` image tokens (and cached) counted without image lines, no fee."""
    parts = [image_price(tokens, cached, rates) for tokens, cached in images]
    if unlined[0]:
        parts.append(price(Usage(image_tokens=unlined[0], cached_image_tokens=unlined[1]), rates))
    return Priced(
        images=tuple(parts),
        text=price(Usage(text_tokens=text_tokens), rates),
        output=price(Usage(output_tokens=output_tokens), rates),
    )


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
