"""Where a server process spends its CPU, sampled by py-spy while a benchmark loads it, and
summed into the parts of the gateway's work a reader can act on.

Each sample is a stack; it is counted once for the first part (in the order of PARTS) any
of its frames belongs to, so the parts add up to the samples, whatever else shares a stack.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (part, what a frame of it contains): the first match wins.
PARTS = (
    ("quota and journal (Redis: admit, finish)", ("redis_store.py", "redis/")),
    ("the hop to the engine (aiohttp)", ("aiohttp/", "upstream.py")),
    ("request checks, routing, counting (gateway)", tuple(f"gateway/{name}.py" for name in (
        "prepare", "routing", "state", "handlers", "authentication", "tier_choice", "admission", "forwarding",
        "beside", "relaying", "recording", "engine_watch")) + ("textcount.py", "prompts.py")),
    ("HTTP server (uvicorn, httptools, ASGI front)", ("uvicorn/", "httptools", "gateway/asgi.py")),
    ("JSON (orjson)", ("orjson",)),
    ("event loop and the rest", ("",)),
)


def available() -> bool:
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) is not None or shutil.which("py-spy")


def record(pid: int, seconds: float, *, rate: int = 500) -> subprocess.Popen:
    """Start sampling `pid` for `seconds`; wait() on the result, then summarise() its .output."""
    binary = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    output = Path(tempfile.mkstemp(suffix=".txt", prefix="py-spy-")[1])
    process = subprocess.Popen([binary, "record", "-p", str(pid), "-o", str(output), "-f", "raw", "-r", str(rate),
                                "-d", str(int(seconds)), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process.output = output
    return process


def summarise(path: Path) -> list[tuple[str, float]]:
    """(part, share of the samples) for the parts that have any, largest first."""
    counts, total = collections.Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack:
            continue
        count = int(samples)
        total += count
        frames = stack.split(";")
        part = next(name for name, needles in PARTS if any(n in frame for frame in frames for n in needles))
        counts[part] += count
    path.unlink(missing_ok=True)
    return [(part, count / total) for part, count in counts.most_common()] if total else []
