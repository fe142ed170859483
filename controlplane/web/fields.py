"""Form fields the product pages share."""

from __future__ import annotations

import datetime as dt

from django import forms


class UtcDateTimeField(forms.DateTimeField):
    """A moment, given in UTC or with an offset, that exists in UTC: with its offset moved
    away, 9999-12-31T23:59:59-12:00 lies past the last moment Python and the pages can hold
    (and 0001-01-01T00:00:00+12:00 before the first), and was a 500 wherever it was used."""

    default_error_messages = {
        "out_of_range": "no moment that far out can be kept: give one from year 1 to 9999 in UTC",
    }

    def to_python(self, value):
        when = super().to_python(value)
        if when is None:
            return None
        try:
            return when.astimezone(dt.UTC)
        except OverflowError:
            raise forms.ValidationError(self.error_messages["out_of_range"], code="out_of_range") from None
