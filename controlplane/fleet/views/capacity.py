"""The capacity page for operators."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from controlplane.fleet.forms import CapacityForm
from controlplane.imaging import kv
from controlplane.web.access import operators_only


@login_required
def capacity(request):
    """The KV estimator's answers for a model, a GPU and a traffic mix."""
    operators_only(request)
    form = CapacityForm(request.GET or None)
    result = None
    if form.is_valid():
        data = form.cleaned_data
        arch = kv.PRESETS[data["model"]]
        deployment = kv.Deployment(arch, kv.GPUS[data["gpu"]], tensor_parallel=data["tensor_parallel"],
                                   gpu_memory_utilization=data["gpu_memory_utilization"],
                                   kv_cache_dtype=data["kv_cache_dtype"])
        options = {"max_pixels": data["max_pixels"]}
        size = (data["image_width"], data["image_height"])
        mix = [kv.RequestClass(1 - data["image_share"], data["text_tokens"], data["output_tokens"]),
               kv.RequestClass(data["image_share"], data["text_tokens"], data["output_tokens"], (size,))]
        result = {
            "deployment": deployment,
            "per_token": kv.kv_bytes_per_token(arch, kv_cache_dtype=data["kv_cache_dtype"]),
            "per_token_gpu": deployment.kv_bytes_per_token_per_gpu,
            "weights_gib": deployment.weights_bytes_per_gpu / kv.GIB,
            "image_tokens": kv.image_tokens(arch, *size, **options),
            "image_mib": kv.image_kv_bytes(arch, *size, kv_cache_dtype=data["kv_cache_dtype"], **options) / 2**20,
            "fit": kv.concurrency(deployment, mix, **options),
            "largest": kv.largest_resolution(deployment, target_concurrency=data["target_concurrency"],
                                             aspect=size, text_tokens=data["text_tokens"],
                                             output_tokens=data["output_tokens"]),
        }
    return render(request, "fleet/capacity.html", {"form": form, "result": result})
