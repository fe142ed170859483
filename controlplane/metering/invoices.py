"""A tenant's month as a PDF invoice: the statement's lines per tier (requests, images, image
tokens, text and output tokens, what cached images saved, the amount) and a total per
currency, the same figures as the statement page and API (statements.statement makes both)."""

from __future__ import annotations

import datetime as dt

from fpdf import FPDF
from fpdf.fonts import FontFace

from controlplane.metering.rating import money_text

HEADINGS = ("Tier", "Requests", "Images", "Image tokens", "Cached image tokens", "Text tokens", "Output tokens",
            "Saved by cached images", "Amount")


def invoice_number(statement: dict) -> str:
    return f"{statement['tenant']}-{statement['period']}"


def _text(value) -> str:
    """What the PDF's core font can print (Latin-1): anything else becomes '?'."""
    return str(value).encode("latin-1", "replace").decode("latin-1")


def invoice_pdf(statement: dict, *, display_name: str = "", issued: dt.date) -> bytes:
    pdf = FPDF(orientation="landscape", format="A4")
    pdf.set_title(f"Invoice {invoice_number(statement)}")
    pdf.set_creator("VLM control plane")
    pdf.add_page()
    pdf.set_font("Helvetica", "B", 16)
    pdf.cell(0, 10, "Invoice", new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("Helvetica", size=10)
    start, end = statement["from"], statement["to"] - dt.timedelta(days=1)
    for line in (f"Number: {invoice_number(statement)}",
                 f"Tenant: {statement['tenant']}" + (f" ({display_name})" if display_name else ""),
                 f"Period: {statement['period']} ({start:%Y-%m-%d} to {end:%Y-%m-%d}, UTC)",
                 f"Issued: {issued:%Y-%m-%d}"):
        pdf.cell(0, 6, _text(line), new_x="LMARGIN", new_y="NEXT")
    pdf.ln(4)
    pdf.set_font("Helvetica", size=8)
    numbers = ("LEFT", *("RIGHT",) * (len(HEADINGS) - 1))
    with pdf.table(col_widths=(34, 20, 18, 26, 30, 24, 24, 34, 34), text_align=numbers,
                   headings_style=FontFace(emphasis="BOLD")) as table:
        table.row(HEADINGS)
        for line in statement["lines"]:
            table.row([_text(line["tier"]), f"{line['requests']:,}", f"{line['images']:,}", f"{line['image_tokens']:,}",
                       f"{line['cached_image_tokens']:,}", f"{line['text_tokens']:,}", f"{line['output_tokens']:,}",
                       f"{money_text(line['cache_savings'])} {line['currency']}",
                       f"{money_text(line['cost'])} {line['currency']}"])
        if not statement["lines"]:
            table.row(["No billed requests", *("",) * (len(HEADINGS) - 1)])
        for total in statement["totals"]:
            table.row([f"Total in {total['currency']}", *("",) * 6, f"{money_text(total['cache_savings'])} "
                       f"{total['currency']}", f"{money_text(total['total'])} {total['currency']}"],
                      style=FontFace(emphasis="BOLD"))
    pdf.ln(4)
    pdf.set_font("Helvetica", size=8)
    pdf.multi_cell(0, 4, _text(
        "Each request is billed at the price in effect when it was made: each image on its own (its tokens, less "
        "the discount on those the engine reused from its cache, and the per-image fee), then the text and the "
        "output, each rounded to the micro-unit. Requests refused or failed before an engine worked on them are "
        f"not billed ({statement['unbilled_requests']:,} this month)."))
    return bytes(pdf.output())
