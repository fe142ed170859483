"""One way of writing a date on every product page: ISO 8601, with the time zone on a time
("2026-12-06 10:11 UTC"), not "Dec. 6, 2026, 10:11 a.m." beside "2026-12-06"."""

DATE_FORMAT = "Y-m-d"
DATETIME_FORMAT = "Y-m-d H:i T"
SHORT_DATE_FORMAT = "Y-m-d"
SHORT_DATETIME_FORMAT = "Y-m-d H:i T"
TIME_FORMAT = "H:i"
MONTH_DAY_FORMAT = "F j"
YEAR_MONTH_FORMAT = "F Y"
