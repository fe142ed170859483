"""What `make lint` checks holds on the tree: ruff, and imports running one way (the layers
contract in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_code_passes_ruff():
    result = _run("-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_imports_run_one_way_down_the_layers():
    result = _run("-c", "from importlinter.cli import lint_imports_command; lint_imports_command()")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KEPT" in result.stdout
