"""Each app owns its pages, forms and URL patterns; the dashboard mounts them. Imports run one
way: the dashboard may import the apps, and no app imports the dashboard."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = "controlplane.dashboard"


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_module_outside_the_dashboard_imports_it():
    offenders = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for top in ("controlplane", "workers")
        for path in (ROOT / top).rglob("*.py")
        if not path.is_relative_to(ROOT / "controlplane" / "dashboard")
        for name in _imported(path)
        if name == DASHBOARD or name.startswith(DASHBOARD + ".")
    )
    assert offenders == []


def test_the_probe_does_see_an_import_of_the_dashboard(tmp_path):
    # Guards the test itself: a probe that never finds an import would pass vacuously.
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from controlplane.dashboard.views import index\n")
    assert "controlplane.dashboard.views" in _imported(module)
