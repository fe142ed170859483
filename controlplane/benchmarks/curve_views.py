"""A resolution run's quality–cost curve for operators: the advisor on it (a target in, the
smallest cap meeting it out, applied to the tier's policy in one step), the curve beside other
runs on the same set, any two of its caps weighed as a cascade's attempts (the threshold's
trade-off), and the curve and its answers as CSV files."""

from __future__ import annotations

from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from controlplane.benchmarks import cascade_curve, charts, curves, selectors
from controlplane.benchmarks.advisor import WITHIN
from controlplane.benchmarks.forms import AdviceForm, CascadeCapsForm
from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun, GateCheck
from controlplane.benchmarks.policy_advice import (
    AdviceError,
    advice_apply,
    advice_lines,
    run_advice,
)
from controlplane.metering.exports import csv_lines
from controlplane.tenants import roles

OTHER_RUNS = 20


def _operator(request):
    if not roles.is_operator(request.user):
        raise PermissionDenied


def _runs():
    return BenchmarkRun.objects.select_related("profile__tier__price_plan")


def curve_name(run: BenchmarkRun) -> str:
    return f"#{run.pk} {charts.Run.of(run).tier}" + (f" {run.label}" if run.label else "")


class CurveRunsForm(forms.Form):
    """Other succeeded sweeps on the same set, drawn on the same chart."""

    also = forms.MultipleChoiceField(label="Draw beside it", required=False, choices=[],
                                     widget=forms.CheckboxSelectMultiple)

    def __init__(self, *args, run: BenchmarkRun, **kwargs):
        super().__init__(*args, **kwargs)
        others = list(_runs().filter(state=BenchmarkRun.State.SUCCEEDED, profile__kind=BenchmarkProfile.Kind.RESOLUTION,
                                     config__eval_set=(run.config or {}).get("eval_set"))
                      .exclude(pk=run.pk)[:OTHER_RUNS])
        self.others = {str(other.pk): other for other in others}
        self.fields["also"].choices = [(pk, curve_name(other)) for pk, other in self.others.items()]

    def chosen(self) -> list[BenchmarkRun]:
        return [self.others[pk] for pk in self.cleaned_data["also"]] if self.is_valid() else []


def run_curve_context(request, run: BenchmarkRun, *, colours: dict[str, str]) -> dict:
    """What the run page shows of the curve: the chart of the set's accuracy against cost (with
    the runs asked for beside it) and the advisor, with its advice when a target was given."""
    if not selectors.curve_points(run.results or {}):
        return {}
    curve_form = CurveRunsForm(request.GET if "also" in request.GET else None, run=run)
    drawn = [run, *curve_form.chosen()]
    context = {"curve_form": curve_form,
               "curve_chart": charts.set_curve_chart([charts.Run.of(each, curve_name(each)) for each in drawn],
                                                     currency=selectors.runs_currency(drawn), colours=colours)}
    if run.state != BenchmarkRun.State.SUCCEEDED:
        return context
    asked = "target_kind" in request.GET
    form = AdviceForm(request.GET if asked else None, initial={"target_kind": WITHIN, "target_points": 2})
    context["advice_form"] = form
    if asked and form.is_valid():
        try:
            context["advice"] = found = run_advice(run=run, target=form.target())
            context["advice_lines"] = advice_lines(found)
        except AdviceError as exc:
            context["advice_error"] = str(exc)
    return context


CASCADE_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, cascade_curve.ALWAYS)


def run_cascade_context(request, run: BenchmarkRun, *, colours: dict[str, str]) -> dict:
    """Two caps of the run as a cascade's cheap and strong attempts: what each threshold on the
    cheap answer's token probability would give, accuracy against cost, and the cheapest
    threshold within a point and within two of always escalating."""
    results = run.results or {}
    caps = cascade_curve.weighed_caps(results)
    if len(caps) < 2:
        return {}
    form = CascadeCapsForm(request.GET if "cheap_cap" in request.GET else None, caps=caps)
    cheap, strong = (form.cleaned_data["cheap_cap"], form.cleaned_data["strong_cap"]) if form.is_valid() \
        else (caps[0], caps[-1])
    items = cascade_curve.run_items(results, cheap, strong)
    if not items:
        return {"cascade_form": form}
    points = cascade_curve.curve(items)
    always = cascade_curve.point(items, cascade_curve.ALWAYS)
    picks = [(f"within {gap} point{'s' if gap > 1 else ''} of always escalating",
              cascade_curve.cheapest_within(points, always.accuracy - gap / 100)) for gap in (1, 2)]
    return {"cascade_form": form, "cascade_items": len(items),
            "cascade_chart": charts.cascade_chart(points, cheap_cap=cheap, strong_cap=strong,
                                                  tier=charts.Run.of(run).tier, currency=selectors.run_currency(run),
                                                  colours=colours),
            "cascade_rows": [cascade_curve.point(items, t) for t in CASCADE_THRESHOLDS],
            "cascade_picks": [(name, pick) for name, pick in picks if pick is not None]}


@login_required
@require_POST
def run_advice_apply(request, pk: int):
    _operator(request)
    run = get_object_or_404(_runs(), pk=pk)
    form = AdviceForm(request.POST)
    back = reverse("benchmarks:run", kwargs={"pk": pk})
    if not form.is_valid():
        messages.error(request, "; ".join(f"{name}: {e}" for name, errors in form.errors.items() for e in errors))
        return redirect(back)
    back += "?" + urlencode({"target_kind": form.cleaned_data["target_kind"],
                             "target_points": f"{form.cleaned_data['target_points']:g}"})
    try:
        done = advice_apply(run=run, target=form.target(), stamp=form.cleaned_data["stamp"], user=request.user)
    except AdviceError as exc:
        messages.error(request, f"Not applied: {exc}.")
        return redirect(back)
    if isinstance(done, GateCheck):
        messages.info(request, f"{done.policy.name} is used by a gated tier: the change to "
                               f"{done.proposed['max_pixels']:,} px is being measured before it goes live.")
        return redirect("benchmarks:gate-check", pk=done.pk)
    messages.success(request, f"Policy {done.name} now caps images at {done.max_pixels:,} px.")
    return redirect(back)


def _csv(name: str, columns: list[str], rows) -> HttpResponse:
    response = HttpResponse(b"".join(csv_lines(columns, rows)), content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


def _sweep(pk: int) -> BenchmarkRun:
    run = get_object_or_404(BenchmarkRun, pk=pk)
    if not (run.results or {}).get("caps"):
        raise Http404("this run is not a resolution sweep with results")
    return run


@login_required
@require_GET
def run_curve_csv(request, pk: int):
    _operator(request)
    run = _sweep(pk)
    return _csv(f"run-{run.pk}-curve.csv", curves.CURVE_COLUMNS, curves.curve_rows(run.results))


@login_required
@require_GET
def run_answers_csv(request, pk: int):
    _operator(request)
    run = _sweep(pk)
    return _csv(f"run-{run.pk}-answers.csv", curves.ANSWER_COLUMNS, curves.answer_rows(run.results))
