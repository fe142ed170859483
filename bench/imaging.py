"""Normalise throughput on one core: the gateway's image policy against a naive pipeline.

    python -m bench.imaging

Each pipeline runs in its own child process (one core, same inputs) so that its peak
resident memory can be read on its own: "peak +MB" is the growth over the child's
resident size before the first image. Naive: full decode, LANCZOS resize, JPEG encode.
Ours: controlplane.imaging.policy.normalise (JPEG draft decoding, reducing_gap resize).
"""

from __future__ import annotations

import io
import math
import multiprocessing
import time

from PIL import Image

from controlplane.imaging.policy import Policy, fit_within, normalise

POLICY = Policy(max_pixels=1_003_520, max_long_edge=8192, max_input_pixels=200_000_000)


def _photo(width: int, height: int, fmt: str) -> bytes:
    # A smooth gradient with detail: compresses like a photo, not like a flat colour.
    base = Image.radial_gradient("L").resize((width, height))
    noise = Image.effect_noise((width, height), 40)
    image = Image.merge("RGB", (base, noise, Image.linear_gradient("L").resize((width, height))))
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return buffer.getvalue()


def naive(data: bytes) -> bytes:
    image = Image.open(io.BytesIO(data)).convert("RGB")
    size = fit_within(image.width, image.height, max_pixels=POLICY.max_pixels, max_long_edge=8192)
    out = io.BytesIO()
    image.resize(size, Image.Resampling.LANCZOS).save(out, "JPEG", quality=90)
    return out.getvalue()


def ours(data: bytes) -> bytes:
    return normalise(data, POLICY).data


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _run(name: str, data: bytes, seconds: float, queue) -> None:
    fn = {"naive": naive, "ours": ours}[name]
    # ru_maxrss survives execve on Linux (it would report the parent's peak); VmHWM is per
    # address space, and writing 5 to clear_refs resets it to the current resident size.
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    baseline = _status_kb("VmRSS")
    fn(data)  # warm up
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        fn(data)
        count += 1
    elapsed = time.perf_counter() - started
    peak = _status_kb("VmHWM")
    queue.put((count / elapsed, (peak - baseline) / 1024))


def measure(name: str, data: bytes, seconds: float = 3.0) -> tuple[float, float]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_run, args=(name, data, seconds, queue))
    child.start()
    result = queue.get(timeout=seconds * 20 + 60)
    child.join()
    return result


def main() -> None:
    inputs = {
        "12 MP JPEG (4000x3000)": _photo(4000, 3000, "JPEG"),
        "4K PNG (3840x2160)": _photo(3840, 2160, "PNG"),
        "WebP (3000x2000)": _photo(3000, 2000, "WEBP"),
    }
    print(f"target: at most {POLICY.max_pixels:,} pixels, JPEG q90, one core per pipeline\n")
    print(f"{'input':26} {'pipeline':8} {'images/s':>9} {'peak +MB':>12} {'speed-up':>9}")
    for label, data in inputs.items():
        naive_rate, naive_rss = measure("naive", data)
        our_rate, our_rss = measure("ours", data)
        print(f"{label:26} {'naive':8} {naive_rate:9.2f} {naive_rss:12.0f}")
        print(f"{'':26} {'ours':8} {our_rate:9.2f} {our_rss:12.0f} {our_rate / naive_rate:8.1f}x")
    print(f"\n(sqrt of the area ratio for the JPEG: {math.sqrt(12e6 / POLICY.max_pixels):.1f}x per side)")


if __name__ == "__main__":
    main()
