"""The forms of the fleet pages."""

from django import forms


class CapacityForm(forms.Form):
    from controlplane.imaging.kv import DTYPE_BYTES, GPUS, PRESETS

    model = forms.ChoiceField(choices=[(k, v.model_id) for k, v in PRESETS.items()], initial="qwen2.5-vl-7b")
    gpu = forms.ChoiceField(choices=[(name, name) for name in GPUS], initial="H100 80GB", label="GPU")
    tensor_parallel = forms.TypedChoiceField(choices=[(n, n) for n in (1, 2, 4, 8)], coerce=int, initial=1,
                                             label="GPUs per engine (tensor parallel)")
    gpu_memory_utilization = forms.FloatField(min_value=0.1, max_value=0.99, initial=0.9,
                                              label="Share of GPU memory the engine takes")
    kv_cache_dtype = forms.ChoiceField(choices=[(k, k) for k in ("auto", "fp8")], initial="auto",
                                       label="KV cache precision")
    image_share = forms.FloatField(min_value=0, max_value=1, initial=0.5, label="Share of requests with an image")
    image_width = forms.IntegerField(min_value=16, max_value=16384, initial=1920)
    image_height = forms.IntegerField(min_value=16, max_value=16384, initial=1080)
    max_pixels = forms.IntegerField(min_value=3136, initial=1_003_520, label="Policy pixel cap")
    text_tokens = forms.IntegerField(min_value=1, initial=200)
    output_tokens = forms.IntegerField(min_value=1, initial=256)
    target_concurrency = forms.IntegerField(min_value=1, initial=64)
    del DTYPE_BYTES
