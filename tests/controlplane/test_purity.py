"""The pure modules import neither Django nor Celery: engines and the gateway's request
preparation run on hosts (and in processes) that have no settings configured."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PURE_MODULES = [
    "controlplane.imaging.policy",
    "controlplane.imaging.tokens",
    "controlplane.imaging.decode",
    "controlplane.imaging.fetch",
    "controlplane.outbound",
    "controlplane.imaging.fingerprint",
    "controlplane.imaging.intake",
    "controlplane.imaging.kv",
    "controlplane.textcount",
    "controlplane.client_slots",
    "controlplane.prompts",
    "controlplane.metering.rating",
    "controlplane.benchmarks.scoring",
    "controlplane.benchmarks.evalfiles",
    "controlplane.alerts.slack",
    "controlplane.gateway.prepare",
    "controlplane.gateway.validation",
    "workers.engines.launch",
    "workers.engines.simulator.engine",
    "controlplane.imaging.synthetic",
    "controlplane.intervals",
    "controlplane.benchmarks.advisor",
    "controlplane.benchmarks.curves",
    "controlplane.fleet.engine_metrics",
]

_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("django", "celery"))))
"""


def _framework_modules_after_importing(*modules):
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_neither_django_nor_celery(module):
    assert _framework_modules_after_importing(module) == []


def test_all_pure_modules_together_import_neither_django_nor_celery():
    assert _framework_modules_after_importing(*PURE_MODULES) == []


def test_the_probe_does_see_django_when_it_is_imported():
    # Guards the test itself: a probe that never reports anything would pass vacuously.
    assert "django" in _framework_modules_after_importing("django.utils.timezone")
