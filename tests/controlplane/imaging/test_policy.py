"""The resolution policy: what a tenant's image becomes before it reaches the engine."""

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from controlplane.imaging.errors import (
    CorruptImage,
    ImageTooLarge,
    InvalidDataURL,
    PolicyViolation,
    UnsupportedFormat,
)
from controlplane.imaging.fingerprint import FingerprintIndex
from controlplane.imaging.policy import Policy, decode_data_url, normalise, normalise_tiles
from tests.images import data_url, image_bytes

STANDARD = Policy()  # max_pixels 1003520, low detail 200704
LOSSLESS = Policy(output_format="png")  # exact pixels in the output, for pixel checks


def encode(image, fmt, **save):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def decoded(result):
    image = Image.open(io.BytesIO(result.data))
    image.load()
    return image


def png_header_only(width, height):
    """A PNG that declares `width`x`height` but carries almost no pixel data: reading its
    header is cheap, decoding it fails. Refusing it as too large proves nothing was decoded."""

    def chunk(kind, payload):
        return (struct.pack(">I", len(payload)) + kind + payload
                + struct.pack(">I", zlib.crc32(kind + payload)))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def noisy_rgb(width, height, seed=0):
    import random

    rng = random.Random(seed)
    return Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))


# --- downscaling -------------------------------------------------------------------------


def test_large_jpeg_is_brought_within_max_pixels_keeping_aspect_ratio():
    result = normalise(image_bytes(4000, 3000), STANDARD)
    assert result.width * result.height <= STANDARD.max_pixels
    # the largest 4:3 size inside the cap: sqrt(1003520 / 12e6) * (4000, 3000), floored
    assert (result.width, result.height) == (1156, 867)
    assert result.width / result.height == pytest.approx(4 / 3, rel=2e-3)
    assert (result.source_format, result.source_width, result.source_height) == ("JPEG", 4000, 3000)
    assert result.mime == "image/jpeg"
    out = decoded(result)
    assert out.format == "JPEG" and out.size == (1156, 867) and out.mode == "RGB"


def test_small_image_is_not_upscaled():
    result = normalise(image_bytes(320, 200, fmt="PNG"), STANDARD)
    assert (result.width, result.height) == (320, 200)
    assert decoded(result).format == "JPEG"


def test_long_edge_cap_applies_even_under_the_pixel_cap():
    policy = Policy(max_long_edge=1000, max_aspect_ratio=20)
    result = normalise(image_bytes(3000, 300), policy)
    assert (result.width, result.height) == (1000, 100)


def test_data_url_of_the_result_round_trips():
    result = normalise(image_bytes(64, 48), STANDARD)
    url = result.data_url()
    assert url.startswith("data:image/jpeg;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == result.data


def test_png_and_webp_output_formats():
    png = normalise(image_bytes(64, 48), Policy(output_format="png"))
    webp = normalise(image_bytes(64, 48), Policy(output_format="webp"))
    assert (png.mime, decoded(png).format) == ("image/png", "PNG")
    assert (webp.mime, decoded(webp).format) == ("image/webp", "WEBP")


# --- orientation and colour --------------------------------------------------------------


def test_exif_orientation_6_is_applied_and_swaps_width_and_height():
    stored = Image.new("RGB", (400, 200), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 200, 200))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    result = normalise(encode(stored, "JPEG", exif=exif, quality=95), LOSSLESS)
    assert (result.width, result.height) == (200, 400)
    assert (result.source_width, result.source_height) == (200, 400)
    out = decoded(result)
    # turned clockwise, the stored left half ends up on top
    top, bottom = out.getpixel((100, 50)), out.getpixel((100, 350))
    assert top[0] > 200 and top[2] < 60
    assert bottom[2] > 200 and bottom[0] < 60


def test_exif_rotated_large_jpeg_is_capped_in_display_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6
    result = normalise(image_bytes(4000, 3000, exif=exif), STANDARD)
    assert (result.width, result.height) == (867, 1156)


def test_transparent_png_is_composited_onto_white():
    image = Image.new("RGBA", (40, 20), (255, 0, 0, 0))  # fully transparent red
    image.putpixel((1, 1), (0, 0, 255, 255))  # one opaque blue pixel
    image.putpixel((2, 1), (0, 0, 0, 128))  # half transparent black
    out = decoded(normalise(encode(image, "PNG"), LOSSLESS))
    assert out.mode == "RGB"
    assert out.getpixel((10, 10)) == (255, 255, 255)
    assert out.getpixel((1, 1)) == (0, 0, 255)
    assert all(126 <= c <= 128 for c in out.getpixel((2, 1)))


def test_cmyk_jpeg_decodes_to_rgb():
    result = normalise(encode(Image.new("CMYK", (64, 32), (0, 255, 255, 0)), "JPEG"), LOSSLESS)
    out = decoded(result)
    assert result.source_format == "JPEG" and out.mode == "RGB"
    red, green, blue = out.getpixel((10, 10))
    assert red > 240 and green < 15 and blue < 15


def test_16_bit_grey_png_decodes_to_rgb():
    image = Image.new("I;16", (64, 32), 32768)  # mid grey on a 16-bit scale
    image.putpixel((0, 0), 65535)
    result = normalise(encode(image, "PNG"), LOSSLESS)
    out = decoded(result)
    assert out.mode == "RGB"
    assert out.getpixel((10, 10)) == (128, 128, 128)
    assert out.getpixel((0, 0)) == (255, 255, 255)


def test_palette_gif_decodes_to_rgb():
    image = Image.new("P", (64, 32), 1)
    image.putpalette([255, 255, 0] + [0, 128, 0] + [0, 0, 0] * 254)
    result = normalise(encode(image, "GIF"), LOSSLESS)
    out = decoded(result)
    assert result.source_format == "GIF" and out.mode == "RGB"
    assert out.getpixel((5, 5)) == (0, 128, 0)


# --- refusals ----------------------------------------------------------------------------


def test_truncated_jpeg_is_corrupt():
    data = encode(noisy_rgb(800, 600), "JPEG")
    with pytest.raises(CorruptImage) as caught:
        normalise(data[: len(data) // 2], STANDARD)
    assert caught.value.code == "corrupt_image"


def test_jpeg_cut_inside_its_header_is_corrupt():
    with pytest.raises(CorruptImage):
        normalise(encode(noisy_rgb(80, 60), "JPEG")[:400], STANDARD)


def test_zero_bytes_are_corrupt():
    with pytest.raises(CorruptImage):
        normalise(b"", STANDARD)


def test_svg_is_an_unsupported_format():
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>'
    with pytest.raises(UnsupportedFormat) as caught:
        normalise(svg, STANDARD)
    assert caught.value.code == "unsupported_image_format"


def test_more_pixels_than_max_input_pixels_is_refused_before_decoding():
    # 2000x2000 is under Pillow's own bomb limit: only the policy can refuse it. The
    # header-only PNG is CorruptImage once decoded, so ImageTooLarge means it never was.
    header_only = png_header_only(2000, 2000)
    with pytest.raises(CorruptImage):
        normalise(header_only, Policy())
    with pytest.raises(ImageTooLarge, match="2000x2000") as caught:
        normalise(header_only, Policy(max_input_pixels=1_000_000))
    assert caught.value.code == "image_too_large"


def test_ten_thousand_square_png_is_refused_as_too_large():
    with pytest.raises(ImageTooLarge):
        normalise(png_header_only(10_000, 10_000), Policy(max_input_pixels=1_000_000))


def test_format_outside_allowed_formats_is_refused():
    policy = Policy(allowed_formats=("PNG",))
    with pytest.raises(UnsupportedFormat, match="not allowed"):
        normalise(image_bytes(32, 32, fmt="JPEG"), policy)
    assert normalise(image_bytes(32, 32, fmt="PNG"), policy).source_format == "PNG"


# --- detail and aspect ratio -------------------------------------------------------------


def test_low_detail_uses_the_low_detail_cap():
    data = image_bytes(4000, 3000)
    low = normalise(data, STANDARD, detail="low")
    assert low.width * low.height <= STANDARD.low_detail_max_pixels
    # sqrt(200704 / 12e6) * (4000, 3000), floored
    assert (low.width, low.height) == (517, 387)
    high = normalise(data, STANDARD, detail="high")
    assert (high.width, high.height) == (1156, 867)


def test_auto_detail_follows_the_policy_default():
    data = image_bytes(4000, 3000)
    low_default = Policy(default_detail="low")
    assert normalise(data, low_default, detail="auto").width == 517
    assert normalise(data, low_default).width == 517
    assert normalise(data, STANDARD, detail="auto").width == 1156


@pytest.mark.parametrize("detail", ["medium", "HIGH", ""])
@pytest.mark.parametrize("data", [
    image_bytes(32, 32),
    image_bytes(2400, 1800, "JPEG") + b"<script>fetch('/steal')</script>",  # a large polyglot
    b"",
    b'<svg xmlns="http://www.w3.org/2000/svg"/>',
], ids=["image", "large polyglot", "empty", "svg"])
def test_invalid_detail_is_a_policy_violation(detail, data):
    """Whatever the image: the request's own field is refused first, as it always was."""
    with pytest.raises(PolicyViolation, match="detail"):
        normalise(data, STANDARD, detail=detail)


def test_aspect_ratio_beyond_the_policy_is_a_policy_violation():
    policy = Policy(max_aspect_ratio=20)
    with pytest.raises(PolicyViolation, match="aspect ratio"):
        normalise(image_bytes(2100, 100), policy)  # 21:1 > 20
    with pytest.raises(PolicyViolation):
        normalise(image_bytes(100, 2100, fmt="PNG"), policy)
    assert normalise(image_bytes(2000, 100), policy).width == 2000  # exactly 20:1 passes


# --- fingerprints ------------------------------------------------------------------------


def test_fingerprint_is_the_same_for_the_same_pixels_in_lossless_formats():
    pixels = noisy_rgb(120, 80, seed=1)
    as_png = normalise(encode(pixels, "PNG"), STANDARD)
    as_bmp = normalise(encode(pixels, "BMP"), STANDARD)
    assert as_png.source_format == "PNG" and as_bmp.source_format == "BMP"
    assert as_png.fingerprint == as_bmp.fingerprint
    assert len(as_png.fingerprint) == 32


def test_fingerprint_differs_for_different_images():
    one = normalise(encode(noisy_rgb(120, 80, seed=1), "PNG"), STANDARD)
    other = normalise(encode(noisy_rgb(120, 80, seed=2), "PNG"), STANDARD)
    assert one.fingerprint != other.fingerprint


# --- data URLs ---------------------------------------------------------------------------


def test_decode_data_url_returns_the_bytes():
    data = image_bytes(16, 16)
    assert decode_data_url(data_url(data), max_bytes=1_000_000) == data


@pytest.mark.parametrize("url", [
    "https://example.com/cat.jpg",
    "file:///etc/passwd",
    "",
    "data image/png;base64,AAAA",
])
def test_decode_data_url_refuses_non_data_urls(url):
    with pytest.raises(InvalidDataURL) as caught:
        decode_data_url(url, max_bytes=1_000_000)
    assert caught.value.code == "invalid_image_url"


def test_decode_data_url_refuses_data_urls_that_are_not_base64():
    with pytest.raises(InvalidDataURL, match="base64"):
        decode_data_url("data:image/png,rawbytes", max_bytes=1_000_000)


@pytest.mark.parametrize("payload", ["abc", "@@@@", "AAAA AAAA", "AA==AA"])
def test_decode_data_url_refuses_bad_base64(payload):
    with pytest.raises(InvalidDataURL, match="not valid base64"):
        decode_data_url("data:image/png;base64," + payload, max_bytes=1_000_000)


def test_decode_data_url_refuses_payloads_over_max_bytes():
    url = data_url(b"\xff" * 3000)
    with pytest.raises(ImageTooLarge):
        decode_data_url(url, max_bytes=2999)
    assert len(decode_data_url(url, max_bytes=3000)) == 3000


def test_decode_data_url_refuses_an_empty_payload():
    with pytest.raises(CorruptImage):
        decode_data_url("data:image/png;base64,", max_bytes=1_000_000)


@pytest.mark.parametrize("size", [3001, 3002])
def test_decode_data_url_accepts_a_padded_payload_of_exactly_max_bytes(size):
    data = b"\xff" * size  # base64 of 3001 / 3002 bytes ends in '==' / '='
    assert len(decode_data_url(data_url(data), max_bytes=size)) == size


def test_a_downscaled_image_lands_on_the_processors_grid_at_the_tokens_of_the_original():
    from controlplane.imaging.tokens import count_image_tokens, qwen_smart_resize

    bounds = {"min_pixels": 3136, "max_pixels": 1003520}
    on_grid = normalise(image_bytes(2000, 1500), Policy(grid=28))
    # What Qwen2.5-VL's processor makes of the original photo, so the engine resizes nothing.
    assert (on_grid.height, on_grid.width) == qwen_smart_resize(1500, 2000, factor=28, **bounds) == (840, 1148)
    assert count_image_tokens("qwen2_5_vl", on_grid.width, on_grid.height, **bounds) == 1232
    # Sized off the grid, the processor rounds it up again: 41 tokens more for the same picture.
    off_grid = normalise(image_bytes(2000, 1500), Policy())
    assert count_image_tokens("qwen2_5_vl", off_grid.width, off_grid.height, **bounds) == 1273


def test_an_image_within_the_cap_is_left_to_the_processor():
    small = normalise(image_bytes(1000, 700), Policy(grid=28))
    assert (small.width, small.height) == (1000, 700)


# --- an image the policy leaves as it is ----------------------------------------------------


def test_a_jpeg_within_the_policy_reaches_the_engine_as_it_came():
    photo = image_bytes(1155, 866)  # about 1 MP: within the default 1,003,520-pixel cap
    sent = normalise(photo, Policy(grid=28))
    assert sent.data == photo and (sent.width, sent.height, sent.mime) == (1155, 866, "image/jpeg")
    # Its fingerprint is the one the full decode gives the same picture sent as a PNG.
    as_png = io.BytesIO()
    Image.open(io.BytesIO(photo)).save(as_png, "PNG")
    index = FingerprintIndex()
    assert normalise(photo, Policy(), index=index).fingerprint == normalise(as_png.getvalue(), Policy(),
                                                                            index=index).fingerprint


def test_a_jpeg_sent_as_it_came_can_be_checked_later_and_fails_its_check_if_broken():
    photo = image_bytes(1155, 866)
    later = normalise_tiles(photo, Policy(grid=28), check_later=True)[0]
    assert later.data == photo and later.fingerprint == "" and later.check is not None
    assert later.checked() == normalise(photo, Policy(grid=28))  # its fingerprint, as if checked at once
    # Broken past its header: accepted until its check, which refuses it as the intake would.
    truncated = image_bytes(800, 600)[:-2000]
    unchecked = normalise_tiles(truncated, Policy(), check_later=True)[0]
    with pytest.raises(CorruptImage):
        unchecked.checked()
    # Whatever the policy changes is made at once: nothing left to check.
    assert normalise_tiles(image_bytes(2000, 1500), Policy(), check_later=True)[0].check is None


def test_a_jpeg_the_policy_changes_or_turns_or_that_is_broken_is_not_passed_through():
    assert normalise(image_bytes(2000, 1500), Policy()).data != image_bytes(2000, 1500)  # downscaled
    assert normalise(image_bytes(600, 400), Policy(output_format="webp")).mime == "image/webp"
    turned = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (400, 200), (10, 20, 30)).save(turned, "JPEG", exif=exif)
    upright = normalise(turned.getvalue(), Policy())
    assert (upright.width, upright.height) == (200, 400) and upright.data != turned.getvalue()
    truncated = image_bytes(800, 600)[:-2000]
    with pytest.raises(CorruptImage):
        normalise(truncated, Policy())


def test_a_downscaled_photo_is_the_picture_the_general_path_makes():
    """A colour JPEG brought down whole takes its own way (decoder, libvips and encoder on
    the pixels as they are, on every core); what the engine gets is the picture the general
    path (through Pillow) makes: the same size and fingerprint, the same pixels within JPEG's
    loss, the same encoding (baseline, 4:2:0, the policy's quality)."""
    from tests.images import picture

    original = encode(picture(3).resize((3000, 2000)), "JPEG", quality=92)
    fast = normalise(original, STANDARD)
    general = normalise(original, LOSSLESS)  # PNG output: the general path, its exact pixels
    assert (fast.width, fast.height, fast.mime) == (general.width, general.height, "image/jpeg")
    assert fast.width * fast.height < 3000 * 2000 / 5
    assert fast.fingerprint == general.fingerprint
    sent, exact = decoded(fast), decoded(general)
    differences = [abs(a - b) for a, b in zip(sent.tobytes(), exact.tobytes(), strict=True)]
    assert sum(differences) / len(differences) < 2.5
    assert sent.info.get("progressive") is None and sent.layer[0][1:3] == (2, 2)  # baseline, 4:2:0
    reference = io.BytesIO()
    exact.save(reference, "JPEG", quality=STANDARD.output_quality)
    assert abs(len(fast.data) - len(reference.getvalue())) < 0.03 * len(reference.getvalue())


def test_every_downscaled_size_is_the_one_the_processor_gives_the_original():
    """Whether the processor downscales is decided on the grid-rounded size: a 484x2093 photo
    (over the cap by its own pixels, under it once rounded) becomes 476x2100 there, 1,277 tokens,
    not the 476x2072 a plain floor gives (1,260). Every size the gateway downscales by the
    pixel cap is the processor's size for the original, so the engine resizes nothing."""
    from controlplane.imaging.policy import sent_sizes
    from controlplane.imaging.tokens import qwen_smart_resize

    bounds = {"min_pixels": 3136, "max_pixels": 1003520}
    policy = Policy(grid=28, max_long_edge=65535, max_aspect_ratio=200)
    assert sent_sizes(484, 2093, policy) == [(476, 2100)]
    mismatched = []
    for width in range(300, 3000, 7):
        for height in range(300, 3000, 11):
            if width * height <= bounds["max_pixels"]:
                continue  # within the cap: sent as it is, the processor's to resize
            [(sent_w, sent_h)] = sent_sizes(width, height, policy)
            if (sent_h, sent_w) != qwen_smart_resize(height, width, factor=28, **bounds):
                mismatched.append((width, height))
    assert mismatched == []


def test_a_process_forked_after_downscaling_downscales_too():
    """Neither the helper threads nor libvips survive a fork: a worker forked from a process
    that had already downscaled a photo must not wait for ever on threads that are gone. It
    makes the same picture (with Pillow's resample where libvips cannot run)."""
    import multiprocessing

    from tests.images import picture

    photo = encode(picture(5).resize((2400, 1800)), "JPEG", quality=90)
    before = normalise(photo, STANDARD)  # the parent's helper threads and libvips have run
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=lambda: results.put(normalise(photo, STANDARD)))
    child.start()
    try:
        after = results.get(timeout=20)
        assert (after.width, after.height) == (before.width, before.height)
        sent, made = decoded(after).tobytes(), decoded(before).tobytes()
        assert sum(abs(a - b) for a, b in zip(sent, made, strict=True)) / len(sent) < 2
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
