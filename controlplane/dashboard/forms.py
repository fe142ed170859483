from django import forms

from controlplane.tenants.models import Tenant


class ApiKeyForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.filter(active=True))
    name = forms.CharField(max_length=64, required=False)
    expires_at = forms.DateTimeField(required=False, help_text="Optional, UTC")
