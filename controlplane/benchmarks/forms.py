from __future__ import annotations

import io

from django import forms
from django.conf import settings
from PIL import Image, UnidentifiedImageError

from controlplane.benchmarks import evalfiles, presence
from controlplane.benchmarks.advisor import TARGET_KINDS, Target
from controlplane.benchmarks.models import BenchmarkProfile, EvalItem, EvalSet
from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance
from controlplane.imaging import synthetic
from controlplane.tenants.models import Tenant


class ProfileForm(forms.ModelForm):
    gateway_url = forms.URLField(
        assume_scheme="http", required=False, label="Gateway URL",
        help_text=BenchmarkProfile._meta.get_field("gateway_url").help_text)

    class Meta:
        model = BenchmarkProfile
        fields = ["name", "description", "kind", "tier", "target", "gateway_url", "instance", "text_share",
                  "images_per_request_min", "images_per_request_max", "image_source", "image_buckets",
                  "prompt_tokens_min", "prompt_tokens_max", "output_tokens_min", "output_tokens_max",
                  "arrival", "sweep", "stage_duration_s", "seed", "eval_set", "pixel_caps", "ttft_slo_ms",
                  "tpot_slo_ms", "schedule_enabled", "schedule_cron"]
        widgets = {"description": forms.Textarea(attrs={"rows": 2}),
                   "image_buckets": forms.Textarea(attrs={"rows": 3})}
        # In words: the columns' names read as code ("Ttft slo ms").
        labels = {"text_share": "Share of text-only requests",
                  "images_per_request_min": "Fewest images per request",
                  "images_per_request_max": "Most images per request", "image_buckets": "Image sizes",
                  "prompt_tokens_min": "Fewest prompt tokens", "prompt_tokens_max": "Most prompt tokens",
                  "output_tokens_min": "Fewest output tokens", "output_tokens_max": "Most output tokens",
                  "sweep": "Load levels", "stage_duration_s": "Seconds per level", "eval_set": "Evaluation set",
                  "ttft_slo_ms": "Time to first token objective (ms)",
                  "tpot_slo_ms": "Time per output token objective (ms)",
                  "schedule_enabled": "Run on a schedule", "schedule_cron": "Schedule (cron)"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
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
    question = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), max_length=4000)
    answers = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}),
                              help_text="Accepted answers, one per line (a presence question's: yes or no)")

    field_order = ["task_type", "question", "answers", "image"]

    def clean_image(self):
        upload = self.cleaned_data["image"]
        if upload.size > evalfiles.MAX_IMAGE_BYTES:
            raise forms.ValidationError("images up to 20 MB")
        data = upload.read()
        try:  # the checks an imported item's image passes
            content_type, width, height = evalfiles.checked_image(data)
        except evalfiles.RowRefused as exc:
            raise forms.ValidationError(str(exc)) from None
        self.image_info = {"content_type": content_type, "width": width, "height": height, "data": data}
        return upload

    def clean(self):
        cleaned = super().clean()
        answers = [line.strip() for line in (cleaned.get("answers") or "").splitlines() if line.strip()]
        if not answers and "answers" not in self.errors:
            self.add_error("answers", "at least one accepted answer")
        elif cleaned.get("task_type") == EvalItem.TaskType.PRESENCE and answers:
            try:
                answers = [presence.truth(answers)]
            except ValueError:
                self.add_error("answers", "a presence question's answer is yes or no")
        cleaned["answer_list"] = answers
        return cleaned

    def item_fields(self) -> dict:
        return {**self.image_info, "task_type": self.cleaned_data["task_type"], "question": self.cleaned_data["question"],
                "answers": self.cleaned_data["answer_list"]}


def _generators() -> list[tuple[str, str]]:
    return [(task, EvalItem.TaskType(task).label if task in EvalItem.TaskType.values else task)
            for task in synthetic.TASKS]


class EvalSetNameField(forms.CharField):
    def __init__(self, **kwargs):
        super().__init__(max_length=128, **kwargs)

    def clean(self, value):
        value = super().clean(value).strip()
        if not value:
            raise forms.ValidationError("a set needs a name")
        if EvalSet.objects.filter(name=value).exists():
            raise forms.ValidationError("a set of this name exists already")
        return value


class EvalSetGenerateForm(forms.Form):
    MAX_COUNT = 500  # generated within the request: 500 receipt strips take about 6 s

    name = EvalSetNameField()
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    task = forms.ChoiceField(choices=_generators)
    count = forms.IntegerField(min_value=1, max_value=MAX_COUNT, initial=50)
    seed = forms.IntegerField(min_value=0, max_value=2**31 - 1, initial=0, help_text="The same seed, the same set")


class EvalImportForm(forms.Form):
    name = EvalSetNameField()
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    file = forms.FileField(help_text="JSONL, VLMEvalKit's TSV, or a zip of one with the images it names")
    task_type = forms.ChoiceField(choices=EvalItem.TaskType.choices, initial=EvalItem.TaskType.REASONING,
                                  help_text="For rows that name no task_type")

    def clean_file(self):
        upload = self.cleaned_data["file"]
        if not upload.name.lower().endswith((".jsonl", ".tsv", ".zip")):
            raise forms.ValidationError("a .jsonl, .tsv or .zip file")
        return upload


class CompareForm(forms.Form):
    a = forms.IntegerField(label="Run A (before)")
    b = forms.IntegerField(label="Run B (after)")


class GateForm(forms.Form):
    tier = forms.ModelChoiceField(queryset=None, help_text="Its resolution policy's changes are checked first")
    eval_set = forms.ModelChoiceField(queryset=None, label="Gate set", help_text="What a change is measured on")
    tolerance_points = forms.FloatField(min_value=0, max_value=100, initial=2.0,
                                        help_text="The largest drop in accuracy, in points, a change may bring")
    max_tokens = forms.IntegerField(min_value=1, max_value=4096, initial=16, label="Longest answer (tokens)",
                                    help_text="Longest answer asked for")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tier"].queryset = ModelTier.objects.filter(kind=ModelTier.Kind.VISION).order_by("name")
        self.fields["eval_set"].queryset = EvalSet.objects.order_by("name")


class OverrideForm(forms.Form):
    reason = forms.CharField(max_length=2000, required=False, widget=forms.Textarea(attrs={"rows": 2}),
                             help_text="Needed to apply a blocked change; kept in the policy's history")


class AdviceForm(forms.Form):
    """A quality target for the advisor; applying its advice also carries the policy's stamp
    as the page showed it."""

    target_kind = forms.ChoiceField(label="Target", choices=[])
    target_points = forms.FloatField(label="Points", min_value=0, max_value=100, initial=2.0,
                                     help_text="N points of the best cap, or X % on the set")
    stamp = forms.CharField(max_length=64, required=False, widget=forms.HiddenInput)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["target_kind"].choices = list(TARGET_KINDS.items())

    def target(self):
        return Target(self.cleaned_data["target_kind"], self.cleaned_data["target_points"])


class ObservedProfileForm(forms.Form):
    """A load profile read from what a tier (or one tenant on it) served over a window."""

    WINDOWS = {"1h": (3600, "the last hour"), "24h": (86400, "the last 24 hours"),
               "7d": (7 * 86400, "the last 7 days"), "30d": (30 * 86400, "the last 30 days")}

    name = forms.SlugField(max_length=64)
    tier = forms.ModelChoiceField(queryset=ModelTier.objects.order_by("name"))
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.order_by("name"), required=False,
                                    empty_label="every tenant", help_text="Whose traffic to read")
    window = forms.ChoiceField(choices=[(key, label) for key, (_, label) in WINDOWS.items()], initial="24h")
    multipliers = forms.CharField(
        initial="1, 2, 4", max_length=100,
        help_text="Load levels as multiples of the observed request rate, e.g. 1, 2, 4")
    stage_duration_s = forms.FloatField(initial=30.0, min_value=0.5, label="Seconds per level")

    def clean_name(self):
        name = self.cleaned_data["name"]
        if BenchmarkProfile.objects.filter(name=name).exists():
            raise forms.ValidationError("a profile of this name exists")
        return name

    def clean_multipliers(self):
        try:
            values = [float(v) for v in self.cleaned_data["multipliers"].replace(",", " ").split()]
        except ValueError:
            raise forms.ValidationError("numbers separated by commas") from None
        if not values or len(values) > 20 or not all(0 < v <= 1000 for v in values):
            raise forms.ValidationError("1 to 20 multipliers, each above 0 and at most 1000")
        return values

    @property
    def seconds(self) -> int:
        return self.WINDOWS[self.cleaned_data["window"]][0]


class CascadeCapsForm(forms.Form):
    """Which two caps of a sweep are weighed as a cascade's cheap and strong attempts."""

    cheap_cap = forms.TypedChoiceField(coerce=int, label="Cheap attempt at")
    strong_cap = forms.TypedChoiceField(coerce=int, label="Strong attempt at")

    def __init__(self, *args, caps: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        choices = [(cap, f"{cap:,} px") for cap in caps]
        self.fields["cheap_cap"].choices = self.fields["strong_cap"].choices = choices

    def clean(self):
        data = super().clean()
        if data.get("cheap_cap") and data.get("cheap_cap") == data.get("strong_cap"):
            raise forms.ValidationError("two different caps")
        return data
