from django import forms

from controlplane.alerts.models import AlertRule, Webhook


class AlertRuleForm(forms.ModelForm):
    """A rule; the bounds of each field for its kind are the model's (AlertRule.clean), so the
    form and any other path agree."""

    class Meta:
        model = AlertRule
        fields = ["name", "kind", "threshold", "window_minutes", "for_seconds", "min_requests", "tier", "tenant",
                  "enabled"]
        labels = {"threshold": "Threshold", "window_minutes": "Window (minutes)",
                  "for_seconds": "Down for (seconds)", "min_requests": "Minimum requests",
                  "tier": "Only tier", "tenant": "Only tenant"}
        help_texts = {"threshold": "Quota use and error rate: a percent; engines: crashes in the window; "
                                   "unrated usage and disagreements: requests in the window; accuracy between sweeps: "
                                   "points lost at a cap"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tier"].empty_label = "every tier"
        self.fields["tenant"].empty_label = "every tenant"


class WebhookForm(forms.ModelForm):
    kinds = forms.MultipleChoiceField(choices=AlertRule.Kind.choices, required=False,
                                      widget=forms.CheckboxSelectMultiple, label="Alerts sent here",
                                      help_text="None ticked: every kind")

    class Meta:
        model = Webhook
        fields = ["name", "url", "enabled", "kinds"]
        labels = {"url": "URL"}
        widgets = {"url": forms.URLInput(attrs={"placeholder": "https://hooks.slack.com/services/…"})}
