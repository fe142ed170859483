"""runlocal's static files: collected once, and left alone while another server serves them."""

from __future__ import annotations

import shutil
from pathlib import Path

from controlplane.fleet.management.commands.runlocal import Command


def _served(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")}


def test_a_second_start_leaves_the_collected_files_as_they_are_until_a_source_changes(settings, tmp_path):
    # A copy of the sources, so that editing one below touches nobody else's files.
    sources = tmp_path / "sources"
    shutil.copytree(Path(settings.BASE_DIR) / "static", sources)
    settings.STATICFILES_DIRS = [sources]
    settings.STATIC_ROOT = tmp_path / "static"
    settings.STATIC_ROOT.mkdir()
    Command()._collect_static()
    first = _served(settings.STATIC_ROOT)
    assert any(name.startswith("vendor/plotly-basic.min.") and name.endswith(".js.br") for name in first)
    # Another server on this host starts while the first serves these files: nothing is rewritten.
    Command()._collect_static()
    assert _served(settings.STATIC_ROOT) == first
    # A source edited since is collected again.
    (sources / "js" / "tables.js").write_text((sources / "js" / "tables.js").read_text() + "\n// edited\n")
    Command()._collect_static()
    assert _served(settings.STATIC_ROOT) != first
