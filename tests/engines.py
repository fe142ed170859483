"""A real simulator engine process for tests that need an upstream."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import httpx

from tests.system.harness import ROOT, free_port, wait_for


@contextlib.contextmanager
def simulator(*, family="qwen2_5_vl", name="vlm-lite", images=4, max_pixels=1003520, extra=()):
    port = free_port()
    argv = [sys.executable, "-m", "workers.engines.simulator", "test-model", "--family", family,
            "--served-model-name", name, "--port", str(port), *extra]
    if images is not None:
        argv += ["--limit-mm-per-prompt", f'{{"image": {images}}}',
                 "--mm-processor-kwargs", f'{{"min_pixels": 3136, "max_pixels": {max_pixels}}}']
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200,
                 timeout=20, what="the simulator to answer /health")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)
