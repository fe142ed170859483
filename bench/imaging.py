"""Normalise throughput on one core: the gateway's image policy against a naive Pillow
pipeline and against transformers' Qwen2VLImageProcessor, on the same inputs.

    python -m bench.imaging          (or: make bench)

Each pipeline runs in its own child process pinned to one core, so that its time and peak
memory are its own: "peak +MB" is the growth of the child's resident memory over its size
before the first image (VmHWM after resetting it through /proc/self/clear_refs). Every child
runs with glibc's malloc defaults (the gateway keeps freed buffers, GATEWAY_HEAP_KEEP_MB,
which speeds every pipeline alike).
- ours:   controlplane.imaging.policy.normalise (a JPEG decoded by libjpeg-turbo at the DCT
          scale that covers the target, others by Pillow; one bicubic resample by libvips;
          JPEG encode; perceptual fingerprint)
- before: the same, decoding and resampling with Pillow as the library did until libvips
          and libjpeg-turbo took those steps over (draft decode, Pillow's bicubic)
- floor:  for a JPEG, only its decode at the DCT scale ours uses: the pixels must be decoded
- naive:  full decode, LANCZOS resize to the same size, JPEG encode
- hf:     full decode, then transformers' Qwen2VLImageProcessor at the same pixel cap
          (resize, rescale, normalise, patchify: what a Python VLM server would run)
The inputs are photo-like (smooth regions, edges, fine grain), not noise, so that their
compressed sizes resemble camera files.
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import os
import time

from PIL import Image, ImageDraw, ImageFilter

from bench.proc import status_kb
from controlplane.imaging.fingerprint import perceptual_bits
from controlplane.imaging.policy import Policy, fit_within, normalise

CAP = 1_003_520
POLICY = Policy(max_pixels=CAP, max_long_edge=8192, max_input_pixels=200_000_000)


def photo(width: int, height: int) -> Image.Image:
    size = (width, height)
    base = Image.merge("RGB", (
        Image.radial_gradient("L").resize(size),
        Image.linear_gradient("L").rotate(90).resize(size),
        Image.radial_gradient("L").resize(size).transpose(Image.Transpose.FLIP_LEFT_RIGHT),
    ))
    grain = Image.effect_noise((width // 4, height // 4), 64).resize(size, Image.Resampling.BICUBIC)
    grain = grain.filter(ImageFilter.GaussianBlur(2))
    image = Image.blend(base, Image.merge("RGB", (grain, grain, grain)), 0.35)
    draw = ImageDraw.Draw(image)
    for x in range(0, width, 97):
        draw.line([(x, 0), (width - x, height)], fill=(x % 255, 80, 200 - x % 200), width=3)
    fine = Image.effect_noise(size, 12)
    return Image.blend(image, Image.merge("RGB", (fine, fine, fine)), 0.08)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def naive(data: bytes) -> object:
    image = Image.open(io.BytesIO(data)).convert("RGB")
    size = fit_within(image.width, image.height, max_pixels=CAP, max_long_edge=8192)
    out = io.BytesIO()
    image.resize(size, Image.Resampling.LANCZOS).save(out, "JPEG", quality=90)
    return out


def ours(data: bytes) -> object:
    return normalise(data, POLICY)


def before(data: bytes) -> object:
    return normalise(data, POLICY)


def _as_before() -> None:
    """Decode and resample as the library did before: Pillow for both."""
    from controlplane.imaging import policy

    policy.turbo_decodable = lambda image: False
    policy.bicubic = lambda image, size, pixels=None: image.resize(size, Image.Resampling.BICUBIC,
                                                                   reducing_gap=2.0)


def floor(data: bytes) -> object:
    from controlplane.imaging.decode import decode_jpeg
    from controlplane.imaging.policy import _dct_scale, plan_tiles

    image = Image.open(io.BytesIO(data))
    if image.format != "JPEG":
        raise ImportError("a JPEG's decode only")
    plan = plan_tiles(image.width, image.height, POLICY, CAP)
    return decode_jpeg(data, image, _dct_scale(image.size, (plan.width, plan.height)))


_hf = None


def hf(data: bytes) -> object:
    global _hf
    if _hf is None:
        from transformers import Qwen2VLImageProcessor

        _hf = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=CAP)
    return _hf(images=Image.open(io.BytesIO(data)).convert("RGB"), return_tensors=None)


PIPELINES = {"ours": ours, "before": before, "floor": floor, "naive": naive, "hf": hf}


def _run(name: str, data: bytes, seconds: float, queue) -> None:
    import pillow_heif

    pillow_heif.register_heif_opener()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    if name == "before":
        _as_before()
    fn = PIPELINES[name]
    try:
        fn(data)  # warm up (and import what the pipeline needs) before measuring memory
    except ImportError as exc:
        queue.put((None, str(exc)))
        return
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    baseline = status_kb("VmRSS")
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        fn(data)
        count += 1
    elapsed = time.perf_counter() - started
    queue.put((count / elapsed, (status_kb("VmHWM") - baseline) / 1024))


def measure(name: str, data: bytes, seconds: float) -> tuple[float | None, float | str]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_run, args=(name, data, seconds, queue))
    child.start()
    result = queue.get(timeout=seconds * 30 + 120)
    child.join()
    return result


def fingerprint_distances() -> tuple[list[int], list[int]]:
    pictures = [photo(800 + 40 * i, 600 - 10 * i) for i in range(6)]
    within = []
    for picture in pictures:
        reference = perceptual_bits(picture)
        for fmt, options in (("JPEG", {"quality": 95}), ("JPEG", {"quality": 75}), ("JPEG", {"quality": 60}),
                             ("WEBP", {"quality": 80}), ("PNG", {})):
            again = Image.open(io.BytesIO(encoded(picture, fmt, **options)))
            within.append(bin(reference ^ perceptual_bits(again)).count("1"))
    between = [bin(perceptual_bits(a) ^ perceptual_bits(b)).count("1") for a, b in itertools.combinations(pictures, 2)]
    return within, between


def main(seconds: float = 3.0) -> None:
    import pillow_heif

    pillow_heif.register_heif_opener()
    twelve = photo(4000, 3000)
    inputs = {
        "12 MP JPEG 4000x3000": encoded(twelve, "JPEG", quality=90),
        "4K PNG 3840x2160": encoded(photo(3840, 2160), "PNG"),
        "12 MP HEIC 4000x3000": encoded(twelve, "HEIF", quality=85),
        "WebP 3000x2000": encoded(photo(3000, 2000), "WEBP", quality=85),
    }
    print(f"target: at most {CAP:,} pixels; one core per pipeline; {seconds:g} s per measurement\n")
    print(f"{'input':24} {'size':>8} {'pipeline':8} {'images/s':>9} {'peak +MB':>9} {'ours vs':>8}")
    for label, data in inputs.items():
        rates = {}
        for name in ("ours", "before", "floor", "naive", "hf"):
            rate, memory = measure(name, data, seconds)
            rates[name] = rate
            if rate is None:
                if name != "floor":
                    print(f"{label:24} {'':>8} {name:8} {'skipped: ' + memory}")
                continue
            versus = "" if name == "ours" else f"{rates['ours'] / rate:7.1f}x"
            shown = label if name == "ours" else ""
            size = f"{len(data) / 1e6:.1f} MB" if name == "ours" else ""
            print(f"{shown:24} {size:>8} {name:8} {rate:9.2f} {memory:9.0f} {versus:>8}")
    within, between = fingerprint_distances()
    print(f"\nfingerprint bits differing (of 63): re-encodings max {max(within)}, "
          f"different pictures min {min(between)}")


if __name__ == "__main__":
    main()
