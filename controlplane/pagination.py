"""How the API's lists are paged."""

from __future__ import annotations

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination


class CheckedLimitOffsetPagination(LimitOffsetPagination):
    """Pages of `limit` rows (100 unless asked, at most 1000) from `offset`. DRF's own takes
    any number, and one past a database integer was a 500; here anything but a whole number
    in range is a 400 that names the parameter."""

    max_limit = 1000

    def get_limit(self, request):
        raw = request.query_params.get(self.limit_query_param, "")
        if raw == "":
            return self.default_limit
        limit = whole_number(raw)
        if limit is None or limit < 1:
            raise ValidationError({self.limit_query_param: [f"must be a whole number from 1 to {self.max_limit}"]})
        return min(limit, self.max_limit)

    def get_offset(self, request):
        raw = request.query_params.get(self.offset_query_param, "")
        if raw == "":
            return 0
        offset = whole_number(raw)
        if offset is None:
            raise ValidationError({self.offset_query_param: ["must be a whole number, 0 or more"]})
        return offset


def whole_number(text: str) -> int | None:
    """A whole number written in ASCII digits, small enough for a database integer."""
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)
