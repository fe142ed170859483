"""The currencies prices and budgets are in (ISO 4217 codes): price plans bill in one, tenants'
budgets count in one."""

CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CNY", "CHF", "CAD", "AUD", "INR", "SGD", "KRW", "BRL", "SEK")
