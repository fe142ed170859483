"""The documentation site: its reference pages say what the code does now, and it builds
without a warning (a broken link or anchor fails it)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from docs import generate

ROOT = Path(__file__).resolve().parents[2]
# Engine processes: they read what the node agent sets for them (vLLM's own variables, the
# SGLang launcher's), not the operator's configuration.
ENGINE_PROCESSES = {"workers/engines/simulator/__main__.py", "workers/engines/sglang_server.py"}


@pytest.mark.parametrize("path", sorted(generate.PAGES))
def test_a_reference_page_says_what_the_code_does(path):
    page = generate.REFERENCE / path
    assert page.exists(), f"{path} is missing: run `make docs`"
    assert page.read_text() == generate.PAGES[path](), f"{path} is stale: run `make docs`"


def _names_read_directly(tree):
    """Variables read with os.environ / os.getenv instead of the strict readers."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
                 and getattr(node.func.value, "attr", getattr(node.func.value, "id", "")) == "environ")
                or getattr(node.func, "attr", "") == "getenv"):
            yield node.args[0].value
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and getattr(node.value, "attr", "") == "environ" and isinstance(node.slice, ast.Constant):
            yield node.slice.value


def test_every_variable_the_product_reads_is_on_the_environment_page():
    page = (generate.REFERENCE / "environment.md").read_text()
    read = {variable.name for variable in generate.variables()}
    for package in generate.PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() not in ENGINE_PROCESSES:
                read |= set(_names_read_directly(ast.parse(path.read_text())))
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, f"read by the code but not on docs/reference/environment.md: {missing}"
    for name in ("CACHE_KEY_PREFIX", "CSRF_TRUSTED_ORIGINS", "LOCAL_SECRET_KEY", "VAR_DIR"):
        assert f"`{name}`" in page


def test_a_variable_read_without_a_help_text_stops_the_generator(tmp_path, monkeypatch):
    package = tmp_path / "controlplane"
    package.mkdir()
    (package / "settings.py").write_text('X = env_int("UNEXPLAINED_SECONDS", 5, minimum=1)\n')
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    monkeypatch.setattr(generate, "PRODUCT", ("controlplane",))
    with pytest.raises(generate.SourceError, match="UNEXPLAINED_SECONDS is read without a help text"):
        generate.variables()


def test_the_site_builds_without_a_warning(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr
    index = (tmp_path / "site" / "index.html").read_text()
    assert "A first request" in index  # README's getting-started part, included


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
