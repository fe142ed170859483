"""price(): exact Decimal maths, rounded once, half-even, to a micro-unit."""

from decimal import Decimal

import pytest

from controlplane.metering.rating import Rates, Usage, price

RATES = Rates(
    text_input_per_mtok=Decimal("0.20"),
    image_per_mtok=Decimal("0.30"),
    output_per_mtok=Decimal("0.60"),
    per_image_fee=Decimal("0.001"),
    cached_image_discount=Decimal("0.5"),
)
TEXT_ONLY = Rates(text_input_per_mtok=Decimal("0.10"), image_per_mtok=Decimal("0"),
                  output_per_mtok=Decimal("0"))


def test_a_known_request_costs_exactly_what_the_rate_card_says():
    # (100 * 0.20 + 1224 * 0.30 + 50 * 0.60) / 1e6 + 1 * 0.001
    # = (20 + 367.2 + 30) / 1e6 + 0.001 = 0.0014172 -> 0.001417
    usage = Usage(text_tokens=100, image_tokens=1224, output_tokens=50, images=1)
    cost = price(usage, RATES)
    assert cost == Decimal("0.001417")
    assert isinstance(cost, Decimal)
    assert cost.as_tuple().exponent == -6


def test_a_million_tokens_of_each_kind_costs_the_per_mtok_prices():
    usage = Usage(text_tokens=1_000_000, image_tokens=1_000_000, output_tokens=1_000_000)
    assert price(usage, RATES) == Decimal("1.100000")


def test_cached_image_tokens_get_the_discount():
    # 1224 image tokens all cached at a 50% discount bill as 612:
    # (20 + 612 * 0.30 + 30) / 1e6 + 0.001 = 0.0012336 -> 0.001234
    usage = Usage(text_tokens=100, image_tokens=1224, cached_image_tokens=1224,
                  output_tokens=50, images=1)
    assert price(usage, RATES) == Decimal("0.001234")


def test_partly_cached_images_discount_only_the_cached_part():
    rates = Rates(Decimal("0"), Decimal("1"), Decimal("0"), cached_image_discount=Decimal("0.25"))
    # 2000 - 1000 * 0.25 = 1750 billable image tokens at 1 per million
    usage = Usage(image_tokens=2000, cached_image_tokens=1000)
    assert price(usage, rates) == Decimal("0.001750")


def test_no_discount_means_cached_tokens_cost_full_price():
    rates = Rates(Decimal("0"), Decimal("1"), Decimal("0"))
    assert price(Usage(image_tokens=2000, cached_image_tokens=2000), rates) == Decimal("0.002")


def test_per_image_fee_is_charged_per_image():
    rates = Rates(Decimal("0"), Decimal("0"), Decimal("0"), per_image_fee=Decimal("0.0025"))
    assert price(Usage(images=3), rates) == Decimal("0.007500")
    assert price(Usage(images=0), rates) == Decimal("0")


@pytest.mark.parametrize("tokens, expected", [
    (5, "0.000000"),   # 0.5 micro -> even 0
    (15, "0.000002"),  # 1.5 micro -> even 2
    (25, "0.000002"),  # 2.5 micro -> even 2 (half-up would give 3)
    (35, "0.000004"),  # 3.5 micro -> even 4
    (26, "0.000003"),  # 2.6 micro -> nearest 3
    (24, "0.000002"),  # 2.4 micro -> nearest 2
])
def test_rounding_is_half_even_to_a_micro_unit(tokens, expected):
    assert price(Usage(text_tokens=tokens), TEXT_ONLY) == Decimal(expected)


def test_rounding_happens_once_on_the_total_not_per_component():
    # 0.4 micro of text + 0.4 micro of output = 0.8 micro -> 1 micro; rounding each part
    # first would give 0.
    rates = Rates(Decimal("0.1"), Decimal("0"), Decimal("0.1"))
    assert price(Usage(text_tokens=4, output_tokens=4), rates) == Decimal("0.000001")


def test_large_volumes_stay_exact():
    rates = Rates(Decimal("0.123456"), Decimal("0.654321"), Decimal("1.111111"),
                  per_image_fee=Decimal("0.000333"), cached_image_discount=Decimal("0.9"))
    usage = Usage(text_tokens=987_654_321, image_tokens=123_456_789, cached_image_tokens=23_456_789,
                  output_tokens=55_555_555, images=77_777)
    # Worked out with exact fractions (no binary floats anywhere):
    #   text   987654321 * 0.123456 / 1e6                 = 121.931851853376
    #   image  (123456789 - 23456789 * 0.9) * 0.654321 / 1e6 = 66.9669269635269
    #   output 55555555 * 1.111111 / 1e6                  = 61.728388271605
    #   fees   77777 * 0.000333                           = 25.899741
    #   total                                             = 276.5269080885079 -> 276.526908
    assert price(usage, rates) == Decimal("276.526908")


def test_empty_usage_costs_nothing():
    assert price(Usage(), RATES) == Decimal("0.000000")


def test_cached_tokens_above_image_tokens_are_refused():
    with pytest.raises(ValueError, match="cannot exceed"):
        price(Usage(image_tokens=100, cached_image_tokens=101), RATES)
