"""Serves plotly.js from the installed plotly package as static/vendor/plotly.min.js,
so the dashboard needs no CDN and the repository carries no copy of the library."""

from pathlib import Path

import plotly
from django.contrib.staticfiles.finders import BaseFinder
from django.core.files.storage import FileSystemStorage

PLOTLY_JS = "vendor/plotly.min.js"
_SOURCE_DIR = Path(plotly.__file__).parent / "package_data"


class PlotlyFinder(BaseFinder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.storage = FileSystemStorage(location=str(_SOURCE_DIR))
        self.storage.prefix = "vendor"

    def check(self, **kwargs):
        return []

    def find(self, path, find_all=False, **kwargs):
        if path != PLOTLY_JS:
            # Not None: Django's find() collects what each finder returns, and a None among
            # them would come back as a "path" (WhiteNoise then stats a list).
            return []
        match = str(_SOURCE_DIR / "plotly.min.js")
        return [match] if find_all else match

    def list(self, ignore_patterns):
        yield "plotly.min.js", self.storage
