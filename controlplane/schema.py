"""The API's OpenAPI schema, as drf-spectacular writes it."""

from django.conf import settings
from drf_spectacular.views import SpectacularAPIView
from rest_framework.exceptions import ValidationError


class SchemaView(SpectacularAPIView):
    """The schema. The API has one version: drf-spectacular would write any ?version= into the
    schema and into its file name's header (where a newline is a 500), so another is a 400."""

    def _get_version_parameter(self, request):
        version, ours = request.query_params.get("version"), settings.SPECTACULAR_SETTINGS["VERSION"]
        if version not in (None, "", ours):
            raise ValidationError({"version": [f"the API has one version, {ours}"]})
        return version
