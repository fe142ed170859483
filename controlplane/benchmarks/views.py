"""Operator pages: profiles, runs with their progress and results, two runs compared, and
evaluation sets (generated, imported, browsed, deleted)."""

from __future__ import annotations

import io
import itertools

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST
from PIL import Image

from controlplane.benchmarks import (
    charts,
    curve_views,
    curves,
    evalsets,
    observed,
    selectors,
    services,
)
from controlplane.benchmarks.forms import (
    CompareForm,
    EvalImportForm,
    EvalItemForm,
    EvalSetGenerateForm,
    ImageUploadForm,
    ObservedProfileForm,
    ProfileForm,
    RunForm,
)
from controlplane.benchmarks.models import (
    BenchmarkImage,
    BenchmarkProfile,
    BenchmarkRun,
    EvalImport,
    EvalItem,
    EvalSet,
)
from controlplane.catalog.charts import tier_colours
from controlplane.tenants import roles


def _operator(request):
    if not roles.is_operator(request.user):
        raise PermissionDenied


@login_required
def profile_list(request):
    _operator(request)
    profiles = BenchmarkProfile.objects.select_related("tier", "periodic_task").order_by("name")
    runs = BenchmarkRun.objects.select_related("profile")[:30]
    return render(request, "benchmarks/list.html", {"profiles": profiles, "runs": runs,
                                                    "compare_form": CompareForm()})


@login_required
def profile_edit(request, pk: int | None = None):
    _operator(request)
    profile = get_object_or_404(BenchmarkProfile, pk=pk) if pk is not None else None
    form = ProfileForm(request.POST or None, instance=profile)
    if request.method == "POST" and form.is_valid():
        profile = services.profile_save(profile=form.save(commit=False))
        messages.success(request, f"Profile {profile.name} saved.")
        return redirect("benchmarks:profile", pk=profile.pk)
    context = {"form": form, "profile": profile}
    if profile is not None:
        context.update(run_form=RunForm(), upload_form=ImageUploadForm(), images=profile.images.all(),
                       runs=profile.runs.all()[:30])
    return render(request, "benchmarks/profile.html", context)


@login_required
def profile_from_traffic(request):
    """A new load profile read from the traffic a tier served."""
    _operator(request)
    form = ObservedProfileForm(request.POST or None, initial=request.GET or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            profile = services.profile_from_traffic(
                name=data["name"], tier=data["tier"], tenant=data["tenant"], seconds=form.seconds,
                multipliers=data["multipliers"], stage_duration_s=data["stage_duration_s"])
        except observed.NoTraffic:
            form.add_error("window", "no requests in this window (benchmark traffic is left out)")
        except (ValueError, ValidationError) as exc:
            form.add_error(None, "; ".join(getattr(exc, "messages", None) or [str(exc)]))
        else:
            messages.success(request, f"Profile {profile.name} drawn from traffic.")
            return redirect("benchmarks:profile", pk=profile.pk)
    return render(request, "benchmarks/from_traffic.html", {"form": form})


@login_required
@require_POST
def profile_delete(request, pk: int):
    _operator(request)
    profile = get_object_or_404(BenchmarkProfile, pk=pk)
    services.profile_delete(profile=profile)
    messages.success(request, f"Profile {profile.name} deleted with its runs.")
    return redirect("benchmarks:list")


@login_required
@require_POST
def profile_run(request, pk: int):
    _operator(request)
    profile = get_object_or_404(BenchmarkProfile, pk=pk)
    form = RunForm(request.POST)
    label = form.cleaned_data["label"] if form.is_valid() else ""
    run = services.benchmark_start(profile=profile, label=label, user=request.user)
    return redirect("benchmarks:run", pk=run.pk)


@login_required
@require_POST
def image_upload(request, pk: int):
    _operator(request)
    profile = get_object_or_404(BenchmarkProfile, pk=pk)
    form = ImageUploadForm(request.POST, request.FILES)
    if form.is_valid():
        services.profile_image_add(profile=profile, **form.image_info)
        messages.success(request, f"Image {form.image_info['name']} added.")
    else:
        messages.error(request, "; ".join(e for errors in form.errors.values() for e in errors))
    return redirect("benchmarks:profile", pk=profile.pk)


@login_required
@require_POST
def image_delete(request, pk: int, image_pk: int):
    _operator(request)
    get_object_or_404(BenchmarkImage, pk=image_pk, profile_id=pk).delete()
    return redirect("benchmarks:profile", pk=pk)


@login_required
def run_detail(request, pk: int):
    _operator(request)
    run = get_object_or_404(BenchmarkRun.objects.select_related("profile__tier__price_plan", "created_by"), pk=pk)
    results = run.results or {}
    has_stages = bool(results.get("stages"))
    caps = results.get("caps") or []
    drawn, colours, currency = [charts.Run.of(run)], tier_colours(), selectors.run_currency(run)
    return render(request, "benchmarks/run.html", {
        "run": run, "currency": currency,
        "caps": selectors.cap_task_rows(caps),
        "answers": list(itertools.islice(curves.answer_rows(results), 200)),
        "quality_chart": charts.quality_cost_chart(drawn, currency=currency, colours=colours)
        if any(c["tasks"] for c in caps) else None,
        "resolution_chart": charts.resolution_chart(results, tier=drawn[0].tier, colours=colours) if caps else None,
        "rows": selectors.stage_rows(results),
        "ttft_chart": charts.latency_chart(drawn, colours=colours) if has_stages else None,
        "tpot_chart": charts.latency_chart(drawn, metric="tpot", div_id="tpot-chart", colours=colours)
        if has_stages else None,
        "throughput_chart": charts.throughput_chart(drawn, colours=colours) if has_stages else None,
        "others": BenchmarkRun.objects.filter(profile=run.profile).exclude(pk=run.pk)[:20],
        **curve_views.run_curve_context(request, run, colours=colours),
        **curve_views.run_cascade_context(request, run, colours=colours),
    })


@login_required
@require_POST
def run_cancel(request, pk: int):
    _operator(request)
    run = get_object_or_404(BenchmarkRun, pk=pk)
    services.benchmark_cancel(run=run)
    messages.info(request, "Cancelled." if run.state == "cancelled" else "Stopping: the run keeps what it measured.")
    return redirect("benchmarks:run", pk=pk)


@login_required
def compare(request):
    _operator(request)
    form = CompareForm(request.GET or None)
    context = {"form": form}
    if form.is_valid():
        runs = BenchmarkRun.objects.select_related("profile__tier__price_plan")
        a = get_object_or_404(runs, pk=form.cleaned_data["a"])
        b = get_object_or_404(runs, pk=form.cleaned_data["b"])
        named = [charts.Run.of(a, f"A #{a.pk}"), charts.Run.of(b, f"B #{b.pk}")]
        colours, currency = tier_colours(), selectors.runs_currency([a, b])
        context.update(a=a, b=b, currency_a=selectors.run_currency(a), currency_b=selectors.run_currency(b), rows=selectors.comparison_rows(a, b), changes=selectors.config_changes(a, b),
                       ttft_chart=charts.latency_chart(named, quantiles=("p99",), colours=colours),
                       throughput_chart=charts.throughput_chart(named, colours=colours))
        if any(run.results.get("caps") for run in named):
            context.update(quality_chart=charts.quality_cost_chart(named, currency=currency, colours=colours),
                           caps_rows=selectors.cap_rows(a, b))
            if any(selectors.curve_points(run.results) for run in named):
                context["curve_chart"] = charts.set_curve_chart(named, currency=currency, colours=colours)
    return render(request, "benchmarks/compare.html", context)


@login_required
def evalset_list(request):
    _operator(request)
    evalsets.evalimports_abandoned_end()
    sets = EvalSet.objects.annotate(item_count=Count("items")).select_related("created_by").order_by("name")
    return render(request, "benchmarks/evalsets.html", {
        "sets": sets, "imports": EvalImport.objects.defer("data")[:10],
        "generate_form": EvalSetGenerateForm(), "import_form": EvalImportForm()})


@login_required
@require_POST
def evalset_generate(request):
    _operator(request)
    form = EvalSetGenerateForm(request.POST)
    if form.is_valid():
        data = form.cleaned_data
        try:
            eval_set = evalsets.evalset_generate(name=data["name"], description=data["description"], task=data["task"],
                                                 count=data["count"], seed=data["seed"], user=request.user)
        except evalsets.EvalSetError as exc:
            messages.error(request, str(exc))
        else:
            messages.success(request, f"Set {eval_set.name} generated: {data['count']} items.")
            return redirect("benchmarks:evalset", pk=eval_set.pk)
    else:
        messages.error(request, _form_errors(form))
    return redirect("benchmarks:evalsets")


def _form_errors(form) -> str:
    return "; ".join(f"{name}: {e}" for name, errors in form.errors.items() for e in errors)


@login_required
@require_POST
def evalset_import(request):
    _operator(request)
    form = EvalImportForm(request.POST, request.FILES)
    if not form.is_valid():
        messages.error(request, _form_errors(form))
        return redirect("benchmarks:evalsets")
    upload = form.cleaned_data["file"]
    job = evalsets.evalset_import_start(name=form.cleaned_data["name"], description=form.cleaned_data["description"],
                                        file_name=upload.name, data=upload.read(),
                                        task_type=form.cleaned_data["task_type"], user=request.user)
    return redirect("benchmarks:evalimport", pk=job.pk)


@login_required
def evalimport_detail(request, pk: int):
    _operator(request)
    evalsets.evalimports_abandoned_end()
    job = get_object_or_404(EvalImport.objects.defer("data").select_related("eval_set", "created_by"), pk=pk)
    return render(request, "benchmarks/evalimport.html", {"job": job})


@login_required
def evalset_detail(request, pk: int):
    _operator(request)
    eval_set = get_object_or_404(EvalSet.objects.select_related("created_by"), pk=pk)
    items = eval_set.items.defer("data")
    page = Paginator(items, 50).get_page(request.GET.get("page"))
    return render(request, "benchmarks/evalset.html", {
        "set": eval_set, "page": page, "item_form": EvalItemForm(), "count": page.paginator.count,
        "profiles": eval_set.profiles.order_by("name"),
        "tasks": eval_set.items.values("task_type").annotate(n=Count("id")).order_by("task_type")})


@login_required
@require_POST
def evalset_delete(request, pk: int):
    _operator(request)
    eval_set = get_object_or_404(EvalSet, pk=pk)
    try:
        evalsets.evalset_delete(eval_set=eval_set)
    except evalsets.EvalSetError as exc:
        messages.error(request, str(exc))
        return redirect("benchmarks:evalset", pk=pk)
    messages.success(request, f"Set {eval_set.name} deleted.")
    return redirect("benchmarks:evalsets")


@login_required
@require_POST
def evalitem_add(request, pk: int):
    _operator(request)
    eval_set = get_object_or_404(EvalSet, pk=pk)
    form = EvalItemForm(request.POST, request.FILES)
    if form.is_valid():
        evalsets.eval_item_add(eval_set=eval_set, **form.item_fields())
        messages.success(request, "Item added.")
    else:
        messages.error(request, _form_errors(form))
    return redirect("benchmarks:evalset", pk=pk)


@login_required
@require_POST
def evalitem_delete(request, pk: int, item_pk: int):
    _operator(request)
    get_object_or_404(EvalItem, pk=item_pk, eval_set_id=pk).delete()
    return redirect("benchmarks:evalset", pk=pk)


THUMBNAIL_PX = 160


@login_required
@require_GET
def evalitem_image(request, pk: int, item_pk: int):
    """An item's image, scaled to a thumbnail (checked when it was saved)."""
    _operator(request)
    item = get_object_or_404(EvalItem, pk=item_pk, eval_set_id=pk)
    with Image.open(io.BytesIO(bytes(item.data))) as image:
        image.draft("RGB", (THUMBNAIL_PX, THUMBNAIL_PX))
        thumb = image.convert("RGB")
        thumb.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
    buffer = io.BytesIO()
    thumb.save(buffer, "JPEG", quality=80)
    response = HttpResponse(buffer.getvalue(), content_type="image/jpeg")
    response["Cache-Control"] = "private, max-age=3600"
    return response
