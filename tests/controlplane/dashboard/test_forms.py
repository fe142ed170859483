"""Every form of the console is laid out one way, through common/_field.html: each field under
a label in words, its errors beside it, its help under it; never Django's own table or
paragraphs, whose errors sit in a list above the field."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
from django import forms
from django.forms.utils import pretty_name

from tests.controlplane.benchmarks.runs import form_data

ROOT = Path(__file__).resolve().parents[3]
# Django's layouts of a whole form, and its lists of errors (a form's own, or a field's).
DJANGO_LAYOUT = re.compile(r"\{\{\s*\w*form(\.(as_p|as_table|as_ul|as_div|non_field_errors|\w+\.errors))?\s*\}\}")
# Parts of a field's name that read as code in a label ("Ttft slo ms").
CODED = {"ttft", "tpot", "slo", "ms", "s", "min", "max", "url", "cron", "gpu", "kv", "dtype", "mib", "px"}


def test_no_template_lays_out_a_form_in_djangos_own_layout():
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in sorted((ROOT / "templates").rglob("*.html"))
             for match in DJANGO_LAYOUT.finditer(path.read_text())]
    assert found == []


def _form_classes() -> list[type[forms.BaseForm]]:
    found = []
    for path in sorted((ROOT / "controlplane").rglob("forms.py")):
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, forms.BaseForm) and cls.__module__ == module.__name__]
    return found


def test_fields_are_labelled_in_words_not_by_their_names():
    coded = [f"{cls.__name__}.{name}: {field.label or pretty_name(name)!r}" for cls in _form_classes()
             for name, field in cls.base_fields.items()
             if set(name.split("_")) & CODED and str(field.label or pretty_name(name)) == pretty_name(name)]
    assert coded == []


def _field(page: str, name: str) -> str:
    """The markup common/_field.html wrote for the field `name`: from its div to its end."""
    at = page.index(f'id="id_{name}"')
    return page[page.rindex('<div class="field', 0, at):page.index("</div>", at)]


def _assert_beside(page: str, errors: dict[str, str]):
    for name, error in errors.items():
        field = _field(page, name)
        assert 'class="field invalid"' in field and f'<p class="error">{error}' in field, name


@pytest.mark.django_db
def test_a_new_key_refused_shows_each_error_beside_its_field(client, world):
    client.force_login(world.operator)
    page = client.post("/keys/", {"tenant": "", "requests_per_minute": "0", "spend_limit": "0",
                                  "expires_at": "soon"}).content.decode()
    _assert_beside(page, {"tenant": "This field is required.",
                          "requests_per_minute": "Ensure this value is greater than or equal to 1.",
                          "spend_limit": "Ensure this value is greater than or equal to 0.01.",
                          "expires_at": "Enter a valid date/time."})
    assert "errorlist" not in page


@pytest.mark.django_db
def test_a_benchmark_profile_refused_shows_each_error_beside_its_field(client, world):
    client.force_login(world.operator)
    page = client.post("/benchmarks/new/", form_data(world, ttft_slo_ms="", stage_duration_s="soon")).content.decode()
    _assert_beside(page, {"ttft_slo_ms": "This field is required.", "stage_duration_s": "Enter a number."})
    assert "errorlist" not in page and "Ttft slo ms" not in page
