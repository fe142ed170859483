"""Finance has a statements page per tenant and month, with the figures the API gives the
tenant, reachable from the usage page; a tenant admin sees its own tenant's only."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record

pytestmark = pytest.mark.django_db


def _spend(world):
    now = timezone.now()
    for n in range(1, 6):
        usage_record(record=UsageRecord(request_id=f"s{n}", tenant_id=world.alice.pk, api_key_id=None,
                                        tier_id=(world.vision if n % 2 else world.text).pk, image_tokens=333 * n,
                                        text_tokens=71 * n, output_tokens=13 * n, created_at=now))
    usage_record(record=UsageRecord(request_id="b1", tenant_id=world.bob.pk, api_key_id=None,
                                    tier_id=world.text.pk, text_tokens=5000, created_at=now))
    return f"{now:%Y-%m}"


def _total(page: str) -> str:
    return page.split('id="statement-total">')[1].split("<")[0]


def test_finance_sees_the_same_statement_as_the_api(client, world):
    month = _spend(world)
    api = client.get(f"/api/v1/statements/{month}/", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()
    client.force_login(world.finance)
    assert 'id="to-statements"' in client.get("/").content.decode()  # reachable from the usage page
    page = client.get(f"/statements/?tenant=alice&month={month}").content.decode()
    assert _total(page) == f"{Decimal(api['total']):,.2f} USD" and Decimal(api["total"]) > 0  # to the cent
    table = page.split('id="statement"')[1].split("</tbody>")[0]
    for line in api["lines"]:
        row = table.split(f"<td>{line['tier']}</td>")[1].split("</tr>")[0]
        assert f"{line['requests']:,}" in row and f"{Decimal(line['cost']):,.2f} USD" in row
    assert f"tenant=alice&amp;from={month}-01" in page  # its per-image rows, to reconcile


def test_a_tenant_admin_sees_only_its_own_tenants_statement(client, world):
    month = _spend(world)
    client.force_login(world.alice_admin)
    mine = client.get(f"/statements/?month={month}").content.decode()
    bobs = client.get(f"/statements/?tenant=bob&month={month}").content.decode()
    assert "Statement of alice" in mine and "Statement of alice" in bobs  # ?tenant= is not theirs to choose
    assert _total(mine) == _total(bobs)
    client.force_login(world.charlie_admin)
    assert _total(client.get(f"/statements/?month={month}").content.decode()) == "nothing billed"


def test_a_month_that_is_not_one_is_refused_with_a_message_not_an_error(client, world):
    client.force_login(world.finance)
    for month in ("2026-13", "0000-01", "x" * 500):
        response = client.get(f"/statements/?tenant=alice&month={month}")
        assert response.status_code == 400 and "use YYYY-MM" in response.content.decode()


def test_every_tenants_month_is_one_page_whose_rows_are_their_statements_and_whose_total_adds_them(client, world):
    from controlplane.metering.statements import statement
    from controlplane.tenants.services import internal_tenant

    month = _spend(world)
    internal = internal_tenant()
    usage_record(record=UsageRecord(request_id="bench", tenant_id=internal.pk, api_key_id=None,
                                    tier_id=world.text.pk, text_tokens=9000, created_at=timezone.now()))
    client.force_login(world.finance)
    page = client.get("/statements/", {"month": month}).content.decode()
    table = page.split('id="every-statement"')[1].split("</table>")[0]
    year, number = map(int, month.split("-"))
    bills = {tenant.name: statement(tenant=tenant, year=year, month=number) for tenant in (world.alice, world.bob)}
    for name, bill in bills.items():
        row = table.split(f'data-tenant="{name}"')[1].split("</tr>")[0]
        assert f"{bill['total']:,.2f} USD" in row and f"/statements/{name}/{month}.pdf" in row
    total = table.split('class="statement-total"')[1].split("</tr>")[0]
    assert f"{sum(bill['total'] for bill in bills.values()):,.2f} USD" in total and "Total of 2 tenants" in total
    assert 'data-tenant="internal"' not in table  # the service's own traffic is apart, in no total
    assert "internal</a>, 1 requests" in page.split('id="every-internal"')[1]
    assert "charlie" in page.split("No billed requests: ")[1]
    refused = client.get("/statements/", {"month": month, "tenant": "nobody"})
    assert refused.status_code == 400 and "no tenant &#x27;nobody&#x27; you can see" in refused.content.decode()


def test_a_tenants_month_is_a_pdf_invoice_with_its_statements_lines_and_total(client, world):
    import io

    import pypdf

    from controlplane.metering.statements import statement

    month = _spend(world)
    client.force_login(world.alice_admin)
    response = client.get(f"/statements/alice/{month}.pdf")
    assert response.status_code == 200 and response["Content-Type"] == "application/pdf"
    assert f'filename="invoice-alice-{month}.pdf"' in response["Content-Disposition"]
    text = pypdf.PdfReader(io.BytesIO(response.content)).pages[0].extract_text()
    year, number = map(int, month.split("-"))
    bill = statement(tenant=world.alice, year=year, month=number)
    assert f"Number: alice-{month}" in text and "Total in USD" in text
    for line in bill["lines"]:
        assert f"{line['tier']} {line['requests']:,} {line['images']:,} {line['image_tokens']:,}" in text
        assert f"{line['cost']:.6f} USD" in text
    assert f"{bill['total']:.6f} USD" in text.split("Total in USD")[1]
    assert client.get(f"/statements/bob/{month}.pdf").status_code == 404  # another tenant's
    assert client.get("/statements/alice/2026-13.pdf").status_code == 404
    client.force_login(world.finance)
    assert client.get(f"/statements/bob/{month}.pdf").status_code == 200


def test_a_statements_amounts_are_to_the_cent_each_with_its_currency(client, world):
    month = _spend(world)
    client.force_login(world.finance)
    page = client.get(f"/statements/?tenant=alice&month={month}").content.decode()
    table = page.split('id="statement"')[1].split("</table>")[0]
    amounts = re.findall(r'<t[dh] class="num"[^>]*>([^<]*\.[^<]*)</t[dh]>', table)
    assert amounts and all(re.fullmatch(r"[\d,]+\.\d\d USD", amount) for amount in amounts), amounts
    every = client.get(f"/statements/?month={month}").content.decode().split('id="every-statement"')[1]
    amounts = re.findall(r'<t[dh] class="num"[^>]*>([^<]*\.[^<]*)</t[dh]>', every.split("</table>")[0])
    assert amounts and all(re.fullmatch(r"[\d,]+\.\d\d USD", amount) for amount in amounts), amounts
