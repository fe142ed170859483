"""A large JPEG's resample and encode run behind its decode, a band of rows at a time: the
picture the engine gets is the one the whole-picture way makes, and what a whole decode
refuses is refused."""

from __future__ import annotations

import io
import os
import random
import sysconfig
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import simplejpeg
from PIL import Image, ImageDraw, ImageFilter

from controlplane.imaging import rows
from controlplane.imaging.errors import CorruptImage
from controlplane.imaging.fingerprint import narrowed, narrowed_bits, perceptual_bits
from controlplane.imaging.policy import Policy, _dct_scale, normalise, plan_tiles
from controlplane.imaging.resample import bicubic_rgb

HEADERS = any(os.path.exists(os.path.join(folder, "jpeglib.h"))
              for folder in ("/usr/include", "/usr/local/include", sysconfig.get_paths()["include"]))
needs_rows = pytest.mark.skipif(not rows.compiled(), reason="built only where libjpeg's headers are installed")
POLICY = Policy(max_input_pixels=60_000_000)
LOW = Policy(max_input_pixels=60_000_000, default_detail="low")


def photo(width: int, height: int, *, quality: int = 90, **save) -> bytes:
    """A photo-like JPEG: gradients, edges and grain, so every band of it differs."""
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for k in range(0, width, max(1, width // 23)):
        draw.line([(k, 0), (width - k, height)], fill=(k % 255, 90, 200 - k % 200), width=5)
        draw.ellipse([k, k % height, k + width // 9, k % height + height // 7], fill=(40, k % 255, 120))
    grain = Image.effect_noise((width, height), 40).filter(ImageFilter.GaussianBlur(1))
    image = Image.blend(image, Image.merge("RGB", (grain, grain, grain)), 0.2)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, **save)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def helpers():
    with ThreadPoolExecutor(2) as pool:
        yield pool


def target(data: bytes, policy: Policy = POLICY) -> tuple[int, int, int]:
    opened = Image.open(io.BytesIO(data))
    plan = plan_tiles(*opened.size, policy, policy.pixel_cap(None))
    return plan.width, plan.height, _dct_scale(opened.size, (plan.width, plan.height))


def test_the_row_decoder_is_built_wherever_libjpegs_headers_are():
    """On a machine with libjpeg's headers (this one, CI's) the install compiles it: the
    streamed path is not skipped there by a build that quietly failed."""
    if HEADERS:
        assert rows.compiled()


@needs_rows
@pytest.mark.parametrize("width, height, policy", [
    (4000, 3000, POLICY),  # a phone's photo: decoded at 1/2, the common case
    (3000, 4000, POLICY),  # portrait
    (2401, 1799, POLICY),  # odd sides: the DCT scale rounds up
    (6000, 4000, LOW),     # low detail: decoded at 1/8, brought down by more than 2 (libvips shrinks first)
    (8000, 1000, POLICY),  # wide: few rows of many columns
])
def test_each_band_is_the_whole_pictures_resample_to_the_bit(width, height, policy, helpers):
    data = photo(width, height)
    columns, lines, scale = target(data, policy)
    assert scale > 1
    made = rows.downscale(data, scale, (columns, lines), quality=85, helpers=helpers)
    encoded, streamed = made.jpeg, made.rgb
    whole = simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True,
                                   min_width=-(-width // scale), min_height=-(-height // scale))
    expected = bicubic_rgb(whole, whole.shape[1], whole.shape[0], (columns, lines))
    assert bytes(streamed) == expected
    # The first pass of its fingerprint's thumbnail, made a band at a time, is the whole
    # grey picture's, and so are the bits (a portrait's too, which Pillow's one-call resize of
    # the whole would take columns first).
    grey = Image.frombytes("RGB", (columns, lines), expected).convert("L")
    assert bytes(made.narrow) == narrowed(grey)
    assert narrowed_bits(made.narrow, lines) == perceptual_bits(grey)
    sent = simplejpeg.decode_jpeg(encoded).astype(int)
    assert sent.shape == (lines, columns, 3)
    # The JPEG is that picture within its loss, as the whole-picture encoder makes it.
    reference = simplejpeg.decode_jpeg(simplejpeg.encode_jpeg(
        np.frombuffer(expected, np.uint8).reshape(lines, columns, 3), quality=85, colorspace="RGB",
        colorsubsampling="420", fastdct=False)).astype(int)
    exact = np.frombuffer(expected, np.uint8).reshape(lines, columns, 3).astype(int)
    assert abs(np.abs(sent - exact).mean() - np.abs(reference - exact).mean()) < 0.1
    opened = Image.open(io.BytesIO(encoded))
    assert opened.info.get("progressive") is None and opened.layer[0][1:3] == (2, 2)  # baseline, 4:2:0


@pytest.mark.parametrize("source, size", [
    ((2000, 1500), (1156, 867)),  # a 12 MP photo at half scale to the pixel cap
    ((1200, 900), (1156, 867)),   # hardly reduced
    ((1000, 1500), (333, 500)),   # by 3: libvips shrinks by whole rows before its cubic
    ((750, 1000), (100, 133)),    # by 7.5
])
def test_a_band_reads_no_input_row_beyond_those_it_waits_for(source, size):
    """Each band is computed with only the rows it waits for decoded (the rest still zero),
    and is the whole picture's resample there to the bit."""
    from controlplane.imaging.resample import Bands

    width, height = source
    full = simplejpeg.decode_jpeg(photo(width, height), colorspace="RGB")
    expected = np.frombuffer(bicubic_rgb(full, width, height, size), np.uint8).reshape(size[1], size[0], 3)
    partial = np.zeros_like(full)
    bands = Bands(partial, width, height, size)
    done = 0
    for decoded in [*range(16, height, 16), height]:
        partial[:decoded] = full[:decoded]
        end = bands.ready(decoded)
        assert bands.reads(end) <= decoded and end >= done
        if end > done:
            band = np.frombuffer(bands.rows(done, end), np.uint8).reshape(end - done, size[0], 3)
            assert np.array_equal(band, expected[done:end]), f"rows {done}..{end} with {decoded} decoded"
            done = end
    assert done == size[1]


@needs_rows
def test_a_photo_normalised_streamed_is_the_one_normalised_whole(monkeypatch):
    """Same size, same fingerprint, the same pixels within JPEG's loss, whether the machine
    built the row decoder or not."""
    data = photo(4000, 3000)
    streamed = normalise(data, POLICY)
    monkeypatch.setattr(rows, "_jpegrows", None)  # as on a machine without libjpeg's headers
    assert not rows.streams()
    whole = normalise(data, POLICY)
    assert (streamed.width, streamed.height, streamed.mime) == (whole.width, whole.height, "image/jpeg")
    assert streamed.fingerprint == whole.fingerprint
    a, b = (simplejpeg.decode_jpeg(image.data).astype(int) for image in (streamed, whole))
    assert np.abs(a - b).mean() < 1.0


def _damaged() -> dict[str, bytes]:
    data = photo(2400, 1800)
    middle = len(data) // 2
    progressive = photo(2400, 1800, progressive=True)
    return {
        "cut in its pixels": data[:middle],
        "cut before its end marker": data[:-2],
        "cut near its end": data[:-400],
        "garbage in its pixels": data[:middle] + bytes(range(256)) * 8 + data[middle + 2048:],
        "a progressive photo cut in its scans": progressive[:len(progressive) * 2 // 3],
    }


@needs_rows
@pytest.mark.parametrize("damage", list(_damaged()))
def test_what_a_strict_whole_decode_refuses_the_row_decoder_refuses(damage, helpers):
    data = _damaged()[damage]
    with pytest.raises(ValueError):
        simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True, min_width=1200, min_height=900)
    with pytest.raises(CorruptImage):
        rows.downscale(data, 2, (1156, 867), quality=85, helpers=helpers)
    with pytest.raises(CorruptImage):
        normalise(data, POLICY)


def _mangled(count: int, seed: int = 7):
    """A photo broken in `count` ways, each its own: bits flipped, cut short, garbage inserted,
    a run zeroed."""
    rng, whole = random.Random(seed), photo(800, 600)
    for _ in range(count):
        data = bytearray(whole)
        kind = rng.choice(["flip", "cut", "garbage", "zero"])
        if kind == "flip":
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == "cut":
            data = data[:rng.randrange(len(data))]
        elif kind == "garbage":
            at = rng.randrange(len(data))
            data[at:at] = rng.randbytes(rng.randint(1, 300))
        else:
            at = rng.randrange(len(data))
            data[at:at + 200] = bytes(200)
        yield kind, bytes(data)


@needs_rows
def test_a_mangled_photo_is_refused_or_decoded_as_a_strict_whole_decode_does(helpers):
    """Untrusted bytes through C: two hundred broken photos, each refused (CorruptImage) exactly
    when simplejpeg's strict decode refuses it, and never a crash, a hang or another error."""
    differing = []
    for kind, data in _mangled(200):
        try:
            simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True, min_width=400, min_height=300)
            whole = True
        except ValueError:
            whole = False
        try:
            made = rows.downscale(data, 2, (390, 290), quality=85, helpers=helpers)
            assert Image.open(io.BytesIO(made.jpeg)).size == (390, 290)
            streamed = True
        except CorruptImage:
            streamed = False
        if whole != streamed:
            differing.append((kind, whole, streamed))
    assert differing == []


@needs_rows
def test_a_progressive_photo_is_decoded_by_rows_too(helpers):
    """A progressive JPEG's scans are all read before its first row; its rows come out the same."""
    data = photo(2400, 1800, progressive=True)
    streamed = rows.downscale(data, 2, (1156, 867), quality=85, helpers=helpers).rgb
    whole = simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True, min_width=1200, min_height=900)
    assert bytes(streamed) == bicubic_rgb(whole, 1200, 900, (1156, 867))


@needs_rows
def test_the_decoder_refuses_misuse_with_an_error_never_a_crash():
    from controlplane.imaging import _jpegrows

    data = photo(640, 480)
    for bad in (b"", b"\xff\xd8", b"not a jpeg at all", data[:300]):
        with pytest.raises(ValueError):
            _jpegrows.Decoder(bad, 2)
    with pytest.raises(ValueError):
        _jpegrows.Decoder(data, 3)  # not a DCT scale
    decoder = _jpegrows.Decoder(data, 2)
    assert (decoder.width, decoder.height, decoder.channels) == (320, 240, 3)
    with pytest.raises(ValueError):
        decoder.finish()  # before its rows
    band = np.zeros((100, 320, 3), np.uint8)
    assert decoder.read(band) == 100
    assert decoder.read(np.zeros((2, 10, 3), np.uint8)) == 0  # a buffer too small for one row
    assert decoder.read(band) == 100 and decoder.read(band) == 40
    decoder.finish()
    with pytest.raises(ValueError):
        decoder.read(band)  # finished
    with pytest.raises(TypeError):
        decoder.read(b"read-only")
    encoder = _jpegrows.Encoder(32, 4, 85)
    with pytest.raises(ValueError):
        encoder.write(b"\x00" * 50)  # not whole rows
    with pytest.raises(ValueError):
        encoder.write(b"\x00" * 32 * 3 * 5)  # more rows than the picture has
    with pytest.raises(ValueError):
        encoder.finish()  # before its rows
    encoder.write(b"\x80" * 32 * 3 * 4)
    assert Image.open(io.BytesIO(encoder.finish())).size == (32, 4)
    for width, height, quality in ((0, 4, 85), (4, 70000, 85), (4, 4, 0), (4, 4, 101)):
        with pytest.raises(ValueError):
            _jpegrows.Encoder(width, height, quality)


@needs_rows
def test_a_second_thread_on_a_decoder_in_use_is_refused():
    from controlplane.imaging import _jpegrows

    data = photo(4000, 3000)
    outcomes = []
    for _ in range(5):  # each a whole 12 MP decode, tens of milliseconds with the GIL released
        decoder = _jpegrows.Decoder(data, 1)
        whole = np.zeros((decoder.height, decoder.width, 3), np.uint8)
        started = threading.Thread(target=decoder.read, args=(whole,))
        started.start()
        while started.is_alive():
            try:
                outcomes.append(decoder.read(np.zeros((16, decoder.width, 3), np.uint8)))
            except RuntimeError as exc:
                outcomes.append(str(exc))
        started.join()
        if "the decoder is in use by another thread" in outcomes:
            break
    assert "the decoder is in use by another thread" in outcomes


@needs_rows
def test_a_failed_decode_leaves_the_helper_free(helpers):
    """The helper resampling behind a decode that fails stops; the next picture is served."""
    broken = photo(2400, 1800)[:60_000]
    for _ in range(4):  # more failures than the pool has threads
        with pytest.raises(CorruptImage):
            rows.downscale(broken, 2, (1156, 867), quality=85, helpers=helpers)
    made = rows.downscale(photo(2400, 1800), 2, (1156, 867), quality=85, helpers=helpers)
    assert Image.open(io.BytesIO(made.jpeg)).size == (1156, 867)


@needs_rows
def test_a_photo_refused_beside_its_decode_is_not_decoded_to_its_end(helpers):
    """What runs beside the decode (the search for embedded documents) may refuse the photo:
    the decode then stops, and a hostile upload costs its refusal, not a whole downscale. Its
    last rows are corrupt, so only a decode that stopped early comes back without an error."""
    data = photo(4000, 3000)
    broken_at_its_end = data[:len(data) * 9 // 10] + data[-2:]
    outcomes = []
    for _ in range(5):  # the helper starts within the 30 ms decode on all but the busiest machine
        try:
            outcomes.append(rows.downscale(broken_at_its_end, 2, (1156, 867), quality=85, helpers=helpers,
                                           beside=lambda: "refused"))
        except CorruptImage:
            outcomes.append("decoded to the corrupt end")
        if None in outcomes:
            break
    assert None in outcomes


@needs_rows
def test_a_failure_of_the_work_beside_a_decode_leaves_it_to_the_caller(helpers):
    """The search beside the decode failing (out of memory, say) does not fail the photo: its
    caller runs the search again itself (policy._Documents)."""
    def failing():
        raise MemoryError

    made = rows.downscale(photo(2400, 1800), 2, (1156, 867), quality=85, helpers=helpers, beside=failing)
    assert Image.open(io.BytesIO(made.jpeg)).size == (1156, 867)


@needs_rows
def test_a_downscale_runs_behind_its_decode_only_while_a_core_is_free_for_it(monkeypatch):
    """While every core but one already decodes a photo, the next is decoded whole (bands
    would cost CPU and only take turns with the decodes); the picture is the same either way."""
    import contextlib

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        assert not rows.streams()
        return
    data = photo(4000, 3000)
    streamed = []
    original = rows.downscale
    monkeypatch.setattr(rows, "downscale", lambda *a, **k: streamed.append(True) or original(*a, **k))
    alone = normalise(data, POLICY)
    assert streamed == [True]
    with contextlib.ExitStack() as running:
        assert all(running.enter_context(rows.turn()) for _ in range(cores - 1))
        assert not running.enter_context(rows.turn())
        busy = normalise(data, POLICY)
    assert streamed == [True]  # decoded whole while the cores were taken
    assert normalise(data, POLICY) and streamed == [True, True]  # and behind its decode once they are free
    assert (busy.width, busy.height, busy.fingerprint) == (alone.width, alone.height, alone.fingerprint)


def _streams_once_pinned(results) -> None:
    import controlplane.imaging.policy  # noqa: F401  everything imported, as a server's worker has it

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    results.put((rows.compiled(), rows.streams()))


@needs_rows
def test_a_process_pinned_to_one_core_decodes_whole():
    """Nothing can run behind a decode on the decode's own core: a process pinned to one after
    it started (its modules imported on two) decodes whole pictures."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a fresh process: libvips never ran in it
    results = context.Queue()
    child = context.Process(target=_streams_once_pinned, args=(results,))
    child.start()
    try:
        assert results.get(timeout=60) == (True, False)
    finally:
        child.join(timeout=5)


def _lossless_jpeg(pixels: np.ndarray) -> bytes:
    """A lossless JPEG (SOF3, predictor 1, 8 bits, three components) of `pixels`."""
    import struct

    height, width, _ = pixels.shape
    values = pixels.astype(np.int32)
    predicted = np.empty_like(values)
    predicted[:, 1:] = values[:, :-1]
    predicted[0, 0] = 128
    predicted[1:, 0] = values[:-1, 0]
    differences = (values - predicted).reshape(-1)
    magnitude = np.abs(differences)
    category = np.zeros_like(magnitude)
    nonzero = magnitude > 0
    category[nonzero] = np.floor(np.log2(magnitude[nonzero])).astype(np.int32) + 1
    extra = np.where(differences >= 0, differences, differences - 1) & ((1 << category) - 1)
    length = 5 + category
    aligned = ((category << category) | extra) << (13 - length)
    bits = ((aligned[:, None] >> np.arange(12, -1, -1)) & 1).astype(np.uint8)
    stream = bits[np.arange(13)[None, :] < length[:, None]]
    stream = np.concatenate([stream, np.ones((-len(stream)) % 8, np.uint8)])
    scan = np.packbits(stream).tobytes().replace(b"\xff", b"\xff\x00")
    frame = b"\xff\xc3" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"".join(bytes([i, 0x11, 0]) for i in (1, 2, 3))
    table = b"\xff\xc4" + struct.pack(">H", 36) + b"\x00" + bytes([0, 0, 0, 0, 17] + [0] * 11) + bytes(range(17))
    start = b"\xff\xda" + struct.pack(">HB", 12, 3) + b"".join(bytes([i, 0]) for i in (1, 2, 3)) + bytes([1, 0, 0])
    return b"\xff\xd8" + frame + table + start + scan + b"\xff\xd9"


def _normalised_in_a_child(data: bytes, detail: str | None, queue) -> None:
    from controlplane.imaging.errors import ImageError

    try:
        result = normalise(data, Policy(), detail=detail)
        queue.put(("ok", result.width, result.height))
    except ImageError as exc:
        queue.put(("refused", type(exc).__name__, str(exc)))


@pytest.mark.parametrize("detail", ["high", "low"])  # sent as it came (its check decodes at 1/4); brought down
def test_a_lossless_jpeg_is_refused_with_a_reason_and_never_brings_the_process_down(detail):
    """libjpeg-turbo's scaled decode of a lossless JPEG crashed the process it ran in."""
    import multiprocessing

    pixels = np.asarray(Image.open(io.BytesIO(photo(800, 600))).convert("RGB"))
    data = _lossless_jpeg(pixels)
    assert Image.open(io.BytesIO(data)).format == "JPEG"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_normalised_in_a_child, args=(data, detail, queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0, f"the process died (exit code {child.exitcode})"
    outcome = queue.get(timeout=5)
    assert outcome[:2] == ("refused", "UnsupportedFormat") and "lossless" in outcome[2]


@needs_rows
def test_a_photo_brought_down_to_fewer_rows_than_bands_is_made(helpers):
    """A tiny target from a large photo: fewer output rows than the bands it is taken in."""
    made = rows.downscale(photo(4000, 3000), 8, (26, 19), quality=85, helpers=helpers)
    assert Image.open(io.BytesIO(made.jpeg)).size == (26, 19)
    tiny = normalise(photo(4000, 3000), Policy(max_pixels=500, min_pixels=100))
    assert tiny.width * tiny.height <= 500


@needs_rows
def test_a_photo_in_a_sampling_layout_the_whole_decoder_refuses_is_decoded_whole(monkeypatch):
    """libjpeg-turbo's whole-picture API (simplejpeg) refuses layouts such as luma at 3x1 that
    the scanline API decodes: such a photo is never streamed, even with a core free, so that
    whether it is taken does not depend on the load."""
    from tests.images import picture

    for subsampling in (0, 1, 2):  # 4:4:4, 4:2:2, 4:2:0
        buffer = io.BytesIO()
        picture(2).resize((400, 300)).save(buffer, "JPEG", subsampling=subsampling)
        assert rows.standard_sampling(Image.open(buffer))
    data = bytearray(photo(4000, 3000))
    at = data.index(b"\xff\xc0")  # the frame header: each component's id, sampling, table
    data[at + 11] = 0x31  # luma at 3x1
    data = bytes(data)
    assert [layer[1:3] for layer in Image.open(io.BytesIO(data)).layer] == [(3, 1), (1, 1), (1, 1)]
    assert not rows.standard_sampling(Image.open(io.BytesIO(data)))
    streamed = []
    original = rows.downscale
    monkeypatch.setattr(rows, "downscale", lambda *a, **k: streamed.append(True) or original(*a, **k))
    with pytest.raises(CorruptImage):  # its scan was coded for 2x2: corrupt to either decoder
        normalise(data, POLICY)
    assert streamed == []


@needs_rows
def test_a_photos_bytes_do_not_depend_on_the_path_it_took():
    """The same upload gives the same JPEG whether its resample ran behind its decode or not:
    its bytes key the engines' caches."""
    import contextlib

    data = photo(4000, 3000)
    alone = normalise(data, POLICY).data
    with contextlib.ExitStack() as running:
        for _ in range(len(os.sched_getaffinity(0))):
            running.enter_context(rows.turn())
        busy = normalise(data, POLICY).data
    assert alone == busy


@needs_rows
def test_a_progressive_photos_scans_are_read_with_the_gil_released():
    """libjpeg reads every scan of a progressive JPEG before its first row: that happens with
    the GIL released, so the gateway's event loop runs meanwhile."""
    import time

    from controlplane.imaging import _jpegrows

    data = photo(4000, 3000, progressive=True)
    gaps, running = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not running.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    started = time.perf_counter()
    _jpegrows.Decoder(data, 2)
    took = time.perf_counter() - started
    running.set()
    ticker.join()
    assert took > 0.02  # the scans were read here
    assert max(gaps) < took / 2


@needs_rows
def test_a_decoder_whose_arguments_reenter_it_keeps_hold_of_the_data_it_decodes():
    """Converting an argument runs Python code, which may call __init__ again: the decoder left
    live must still hold the bytes it reads (they cannot be freed under it)."""
    from controlplane.imaging import _jpegrows

    data = bytearray(photo(320, 240))
    decoder = _jpegrows.Decoder(bytes(data), 2)

    class Scale:
        def __index__(self):
            decoder.__init__(data, 2)  # re-entered while the outer call converts its arguments
            return 2

    class Grey:
        def __bool__(self):
            raise RuntimeError("refused")

    with pytest.raises(RuntimeError):
        decoder.__init__(bytes(data), Scale(), Grey())
    with pytest.raises(BufferError):
        data.clear()  # still exported to the decoder reading it
    assert decoder.read(np.zeros((decoder.height, decoder.width, 3), np.uint8)) == 120
    decoder.finish()
