"""How the product's pages write an amount of money: thousands apart, to a fixed number of
places chosen by what the amount is, and always followed by its currency (the filters `money`
and `money_each` of the pages, and the charts' titles)."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

# Totals and bills (a statement, the usage page's totals, what a tier billed, spend and
# budgets): to the cent.
CENTS = Decimal("0.01")
# One request's or one image's amount, and prices per unit: to the micro-unit, the precision a
# request's cost is recorded at (to the cent, most of them would read 0.00).
MICROS = Decimal("0.000001")


def format_money(amount, currency: str, *, each: bool = False) -> str:
    """`amount` in `currency`, to the cent, or to the micro-unit when `each` (one request's or
    image's amount, or a price per unit): "1,234.50 USD", "0.001367 USD"; "—" for no amount."""
    if amount is None or amount == "":
        return "—"
    rounded = Decimal(str(amount)).quantize(MICROS if each else CENTS, rounding=ROUND_HALF_EVEN)
    if rounded == 0:
        rounded = rounded.copy_abs()  # an amount that rounds away is 0.00, never -0.00
    return f"{rounded:,f} {currency}"
