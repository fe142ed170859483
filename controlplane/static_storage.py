"""Static files: hashed names, compressed copies (gzip and brotli), cached for a year.

`collectstatic` (run by runlocal and the image build) writes each file under a name with its
content's hash, with .gz and .br beside it; WhiteNoise serves those compressed to any browser
that accepts it and marks them immutable, so a page's plotly.js is fetched once, not once per
page. Until collectstatic has run, a file keeps its plain name and is served from its source
(uncompressed, briefly cached) rather than failing the page."""

from __future__ import annotations

import os

import brotli
from whitenoise.compress import Compressor
from whitenoise.storage import CompressedManifestStaticFilesStorage

# Brotli's top quality (11) takes 24 s on plotly.js for 1.11 MB; 9 takes 1.2 s for 1.23 MB
# (gzip -9: 1.47 MB). A run of the server should not wait half a minute for 10 % of a file.
BROTLI_QUALITY = 9


class _Compressor(Compressor):
    def compress(self, path):
        # A hashed name is its content: compressed copies already beside it are still right.
        done = [path + suffix for suffix in (".br", ".gz") if os.path.exists(path + suffix)]
        if done and _hashed(path):
            return done
        return super().compress(path)

    @staticmethod
    def compress_brotli(data):
        return brotli.compress(data, quality=BROTLI_QUALITY)


def _hashed(path: str) -> bool:
    stem = os.path.basename(path).rsplit(".", 2)
    return len(stem) == 3 and len(stem[1]) == 12 and all(c in "0123456789abcdef" for c in stem[1])


class StaticStorage(CompressedManifestStaticFilesStorage):
    manifest_strict = False

    def create_compressor(self, **kwargs):
        return _Compressor(**kwargs)

    def url(self, name, force=False):
        # Django names files plainly under DEBUG; a DEBUG run serves what production serves.
        # A file edited meanwhile is named anew at the next start.
        return super().url(name, force=True)

    def stored_name(self, name):
        try:
            return super().stored_name(name)
        except ValueError:  # not collected yet: its plain name, served from the finders
            return name
