"""What a picture may cost to decode is read from its header and refused before any pixel is
decoded, and what the header cannot tell (the decoder's time) is stopped as it runs."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from controlplane.imaging import rows
from controlplane.imaging.budget import DecodeBudget, DecodeLimits
from controlplane.imaging.decode import jpeg_layout
from controlplane.imaging.errors import CorruptImage, ImageTooComplex, ImageTooLarge
from controlplane.imaging.policy import Policy, normalise_tiles
from tests.images import image_bytes
from tests.imaging_corpus import jpeg_scan_bomb, png_claiming, zeros_png

needs_row_decoder = pytest.mark.skipif(not rows.compiled(), reason="the row decoder is not built here")


def test_it_counts_a_jpegs_scans_from_its_markers():
    assert jpeg_layout(image_bytes(640, 480), scan_limit=64).scans == 1
    progressive = image_bytes(640, 480, progressive=True)
    assert jpeg_layout(progressive, scan_limit=64).progressive
    assert 2 < jpeg_layout(progressive, scan_limit=64).scans <= 12
    assert jpeg_layout(jpeg_scan_bomb(400, 300, 500), scan_limit=64).scans == 65  # counted past the limit only


@pytest.mark.parametrize("colour", [False, True])
@pytest.mark.parametrize("size", [(4100, 4000), (1000, 1000)])
def test_a_jpeg_of_thousands_of_scans_is_refused_by_its_header(size, colour):
    """A 'scan bomb': every scan a valid pass of end-of-block runs over the whole picture, so
    libjpeg decodes them all without a warning (seconds of CPU for a file of kilobytes)."""
    bomb = jpeg_scan_bomb(*size, 2646, colour=colour)
    budget = DecodeBudget(pixels=16_000_000)
    with pytest.raises(ImageTooComplex, match="more than 64 scans"):
        normalise_tiles(bomb, Policy(max_pixels=20_000_000, max_long_edge=8192), check_later=True, budget=budget)


def test_a_jpeg_within_the_scan_limit_is_taken():
    taken = normalise_tiles(jpeg_scan_bomb(640, 480, 60), Policy())
    assert (taken[0].width, taken[0].height) == (640, 480)


def test_the_scan_limit_is_the_callers():
    bomb = jpeg_scan_bomb(640, 480, 20)
    with pytest.raises(ImageTooComplex):
        normalise_tiles(bomb, Policy(), budget=DecodeBudget(DecodeLimits(max_scans=10)))


def test_pictures_past_their_requests_total_are_refused_before_decoding():
    """The 16 MP total is reached by the second picture's header: its pixels (garbage, which a
    decode would refuse as corrupt) are never decoded."""
    budget = DecodeBudget(pixels=16_000_000)
    normalise_tiles(image_bytes(3000, 3000), Policy(), budget=budget)
    with pytest.raises(ImageTooLarge, match="exceed 16000000 pixels in total"):
        normalise_tiles(png_claiming(7000, 1100), Policy(), budget=budget)


def test_one_picture_past_the_total_is_refused_before_decoding():
    with pytest.raises(ImageTooLarge, match="pixels in total"):
        normalise_tiles(png_claiming(7000, 7000), Policy(max_total_pixels=16_000_000))
    with pytest.raises(CorruptImage):  # within the total, the same bytes are decoded, and fail
        normalise_tiles(png_claiming(3000, 3000), Policy(max_total_pixels=16_000_000))


def test_a_picture_whose_decode_would_hold_too_much_memory_is_refused_before_decoding():
    small = DecodeLimits(picture_memory=16 << 20, request_memory=64 << 20)
    with pytest.raises(ImageTooLarge, match="at most 16 MB are allowed for one image"):
        normalise_tiles(png_claiming(2000, 2000), Policy(), budget=DecodeBudget(small))
    budget = DecodeBudget(DecodeLimits(picture_memory=16 << 20, request_memory=10 << 20))
    normalise_tiles(image_bytes(1000, 1000), Policy(), budget=budget)  # about 6 MB
    with pytest.raises(ImageTooLarge, match="the images of this request would take more than 10 MB"):
        normalise_tiles(png_claiming(1000, 1000), Policy(), budget=budget)


@needs_row_decoder
@pytest.mark.parametrize("colour", [True, False])
def test_a_jpeg_decode_past_its_cpu_budget_is_stopped(colour):
    """Within the scan limit, a large picture's scans still cost: the decode stops at its CPU
    budget and the thread goes on to other work. Colour takes the downscale, grey the whole decode."""
    bomb = jpeg_scan_bomb(4000, 4000, 60, colour=colour)
    tight = DecodeBudget(DecodeLimits(picture_cpu_s=0.01))
    with pytest.raises(ImageTooComplex, match="budget"):
        normalise_tiles(bomb, Policy(), budget=tight)
    assert tight.cpu_spent >= 0.01


@needs_row_decoder
def test_the_check_of_a_picture_sent_as_it_came_stops_at_its_cpu_budget():
    bomb = jpeg_scan_bomb(1000, 1000, 60)
    [sent] = normalise_tiles(bomb, Policy(), check_later=True, budget=DecodeBudget(DecodeLimits(picture_cpu_s=0.001)))
    assert (sent.width, sent.height) == (1000, 1000)  # its header passed: it may go as it came
    with pytest.raises(ImageTooComplex):
        sent.checked()


def test_a_png_decode_past_its_cpu_budget_is_stopped():
    """Pillow's decoders read their input a block at a time: the read after the budget stops it."""
    budget = DecodeBudget(DecodeLimits(picture_cpu_s=0.001))
    with pytest.raises(ImageTooComplex, match="CPU time"):
        normalise_tiles(zeros_png(4000, 4000), Policy(max_total_pixels=20_000_000), budget=budget)


def test_a_requests_pictures_share_one_cpu_budget():
    budget = DecodeBudget(DecodeLimits(picture_cpu_s=10, request_cpu_s=0.02))
    with pytest.raises(ImageTooComplex):
        for _ in range(100):
            normalise_tiles(zeros_png(1500, 1500), Policy(), budget=budget)
    assert budget.cpu_spent >= 0.02


def test_the_cpu_pictures_took_is_counted():
    budget = DecodeBudget()
    noise = io.BytesIO()
    Image.effect_noise((1200, 900), 80).convert("RGB").save(noise, "PNG")
    normalise_tiles(noise.getvalue(), Policy(), budget=budget)
    assert budget.cpu_spent > 0


def test_a_processs_decodes_hold_no_more_memory_than_it_allows():
    import threading

    from controlplane.imaging.budget import DecodeMemory, DecodersBusy

    shared = DecodeMemory(48 << 20, wait_s=0.05, decodes=4)
    budget = DecodeBudget(shared=shared)
    with shared.holding(40 << 20):  # another request's decode
        with pytest.raises(DecodersBusy):
            normalise_tiles(image_bytes(2400, 1800), Policy(), budget=budget)  # about 26 MB
        small = normalise_tiles(image_bytes(640, 480), Policy(), budget=DecodeBudget(shared=shared))
        assert small[0].width == 640
    # Given back, it is handed to the one waiting.
    waiting = DecodeMemory(48 << 20, wait_s=5, decodes=4)
    held, released = threading.Event(), threading.Event()

    def hold():
        with waiting.holding(40 << 20):
            held.set()
            released.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    threading.Timer(0.05, released.set).start()
    taken = normalise_tiles(image_bytes(2400, 1800), Policy(), budget=DecodeBudget(shared=waiting))
    thread.join()
    assert taken[0].width < 2400 and waiting.held == 0


def test_a_process_runs_no_more_decodes_at_once_than_it_allows():
    from controlplane.imaging.budget import DecodeMemory, DecodersBusy

    shared = DecodeMemory(1 << 30, wait_s=0.05, decodes=1)
    with shared.holding(1 << 20):  # another request's decode
        with pytest.raises(DecodersBusy):
            normalise_tiles(image_bytes(640, 480, "PNG"), Policy(), budget=DecodeBudget(shared=shared))
    assert normalise_tiles(image_bytes(640, 480, "PNG"), Policy(), budget=DecodeBudget(shared=shared))
    assert DecodeMemory(1 << 30, wait_s=0).decodes >= 1  # by default one fewer than the cores, at least one
