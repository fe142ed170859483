from __future__ import annotations

import io

from django import forms
from PIL import Image, UnidentifiedImageError

from controlplane.benchmarks.models import BenchmarkProfile, EvalItem
from controlplane.fleet.models import EngineInstance


class ProfileForm(forms.ModelForm):
    gateway_url = forms.URLField(
        assume_scheme="http", required=False,
        help_text=BenchmarkProfile._meta.get_field("gateway_url").help_text)

    class Meta:
        model = BenchmarkProfile
        fields = ["name", "description", "kind", "tier", "target", "gateway_url", "instance", "text_share",
                  "images_per_request_min", "images_per_request_max", "image_source", "image_buckets",
                  "prompt_tokens_min", "prompt_tokens_max", "output_tokens_min", "output_tokens_max",
                  "arrival", "sweep", "stage_duration_s", "seed", "pixel_caps", "ttft_slo_ms", "tpot_slo_ms",
                  "schedule_enabled", "schedule_cron"]
        widgets = {"description": forms.Textarea(attrs={"rows": 2}),
                   "image_buckets": forms.Textarea(attrs={"rows": 3})}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from django.conf import settings

        self.fields["gateway_url"].widget.attrs["placeholder"] = f"this server's gateway: {settings.GATEWAY_PUBLIC_URL}"
        self.fields["instance"].queryset = EngineInstance.objects.select_related("tier", "node")


class RunForm(forms.Form):
    label = forms.CharField(max_length=128, required=False, help_text="e.g. before / after a change")


class ImageUploadForm(forms.Form):
    MAX_BYTES = 20 * 1024 * 1024
    FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}

    image = forms.FileField(help_text="JPEG, PNG or WebP, up to 20 MB")

    def clean_image(self):
        upload = self.cleaned_data["image"]
        if upload.size > self.MAX_BYTES:
            raise forms.ValidationError("images up to 20 MB")
        data = upload.read()
        try:
            with Image.open(io.BytesIO(data)) as image:
                fmt, (width, height) = image.format, image.size
        except (UnidentifiedImageError, OSError):
            raise forms.ValidationError("not an image this benchmark can send") from None
        if fmt not in self.FORMATS:
            raise forms.ValidationError(f"{fmt} images are not sent as they are; use JPEG, PNG or WebP")
        self.image_info = {"name": upload.name[:255], "content_type": self.FORMATS[fmt], "width": width,
                           "height": height, "data": data}
        return upload


class EvalItemForm(ImageUploadForm):
    task_type = forms.ChoiceField(choices=EvalItem.TaskType.choices)
    question = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}))
    expected = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), required=False,
                               help_text="Accepted answers, one per line (a probe's is a negative)")

    field_order = ["task_type", "question", "expected", "image"]

    def item_fields(self) -> dict:
        return {**self.image_info, "task_type": self.cleaned_data["task_type"],
                "question": self.cleaned_data["question"], "expected": self.cleaned_data["expected"]}


class CompareForm(forms.Form):
    a = forms.IntegerField(label="Run A (before)")
    b = forms.IntegerField(label="Run B (after)")
