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


# An import inside a function hides a module's dependencies and is paid on every call; each
# one left says on its line, or on the line above it (or above its run of imports), why it
# cannot sit at the top: an import cycle, models needed before the apps are ready, a library
# only another environment has.
MOST_LOCAL_IMPORTS = 30
UNEXPLAINED_FOR_NOW = frozenset()


def _local_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, explained) for each import inside a function of the module at `path`."""
    source = path.read_text()
    lines, tree = source.splitlines(), ast.parse(source, str(path))
    imports = {node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))}
    import_lines = {line for node in imports for line in range(node.lineno, node.end_lineno + 1)}
    local = {node for function in ast.walk(tree) if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(function) if node in imports}

    def explained(node) -> bool:
        if "#" in lines[node.lineno - 1]:
            return True
        above = node.lineno - 1  # past the run of imports it belongs to, blank lines between them
        while above in import_lines or (above - 1 in import_lines and not lines[above - 1].strip()):
            above -= 1
        return above > 0 and lines[above - 1].lstrip().startswith("#")

    return sorted((node.lineno, explained(node)) for node in local)


def _modules():
    for top in ("controlplane", "workers"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "migrations" not in path.parts:
                yield path


def test_every_import_inside_a_function_says_why_it_is_there():
    unexplained = sorted(
        f"{path.relative_to(ROOT)}:{line}"
        for path in _modules()
        if path.relative_to(ROOT).as_posix() not in UNEXPLAINED_FOR_NOW
        for line, explained in _local_imports(path)
        if not explained
    )
    assert unexplained == []


def test_imports_inside_functions_stay_few():
    assert sum(len(_local_imports(path)) for path in _modules()) < MOST_LOCAL_IMPORTS


def test_the_probe_tells_an_explained_local_import_from_a_bare_one(tmp_path):
    # Guards the tests themselves: a probe that never finds an import would pass vacuously.
    module = tmp_path / "m.py"
    module.write_text(
        "import os\n"
        "def f():\n"
        "    import json\n"
        "    if os:\n"
        "        import csv  # a reason\n"
        "    # a reason for both\n"
        "    import re\n"
        "    import io\n"
        "\n"
        "    import csv\n"
        "class C:\n"
        "    def g(self):\n"
        "        # about something else\n"
        "\n"
        "        import abc\n"
    )
    assert _local_imports(module) == [(3, False), (5, True), (7, True), (8, True), (10, True), (15, False)]
