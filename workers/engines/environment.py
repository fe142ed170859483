"""Engine environments: a virtualenv of its own per engine (vLLM and SGLang pin their own
torch, transformers and FastAPI), in the user's cache, built once and reused while its stamp
matches the steps that built it. Concurrent callers (parallel test workers) wait for one
build under a file lock."""

from __future__ import annotations

import argparse
import fcntl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from controlplane.env import env_str

STAMP_FILE = "engine-env.stamp"


def cache_path(name: str) -> Path:
    cache = Path(env_str("XDG_CACHE_HOME", str(Path.home() / ".cache"),
                         help="The user's cache: engine environments (vLLM's CPU build, SGLang) are "
                              "built under `XDG_CACHE_HOME/vlm-controlplane/engines/` and reused. "
                              "Default: `~/.cache`."))
    return cache / "vlm-controlplane" / "engines" / name


def python_of(path: Path) -> Path:
    return path / "bin" / "python"


def is_built(path: Path, stamp: str) -> bool:
    written = path / STAMP_FILE
    return python_of(path).exists() and written.exists() and written.read_text().strip() == stamp


def run(python: Path, *args: str) -> str:
    result = subprocess.run([str(python), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result.stdout


def site_packages(python: Path) -> Path:
    return Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())


def ensure_built(path: Path, stamp: str, build: Callable[[Path], None]) -> Path:
    """The environment's Python, `build` run first (then stamped) when it is not built yet."""
    if is_built(path, stamp):
        return python_of(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not is_built(path, stamp):
            build(path)
            (path / STAMP_FILE).write_text(stamp + "\n")
    return python_of(path)


def command_line(argv: list[str] | None, *, doc: str, default: Path, stamp: str, build: Callable[[Path], None],
                 installing: str) -> None:
    """`python -m <installer> [--path DIR]`: build the environment if needed, print its Python."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--path", type=Path, default=default, help=f"default: {default}")
    path = parser.parse_args(argv).path
    if not is_built(path, stamp):
        print(f"installing {installing} into {path}", file=sys.stderr)
    print(ensure_built(path, stamp, build))
