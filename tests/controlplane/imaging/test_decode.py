"""What is not a plain raster image is refused with a reason, before it is decoded."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from controlplane.imaging.decode import _PAYLOAD, PolyglotImage, _payload
from controlplane.imaging.errors import CorruptImage, UnsupportedFormat
from controlplane.imaging.fingerprint import FingerprintIndex
from controlplane.imaging.policy import Policy, normalise
from tests.images import image_bytes

JPEG = image_bytes(320, 240, "JPEG")
# Each way a JPEG goes through the policy: sent as it came, downscaled whole (decoder to
# libvips to encoder), turned by its EXIF orientation (through Pillow).
_TURNED = Image.Exif()
_TURNED[0x0112] = 6
PHOTOS = {"within the policy": JPEG, "downscaled": image_bytes(2400, 1800, "JPEG"),
          "turned": image_bytes(2400, 1800, "JPEG", exif=_TURNED)}


@pytest.mark.parametrize("photo", PHOTOS)
@pytest.mark.parametrize("payload, what", [
    (b"<html><body><script>alert(1)</script></body></html>", "html"),
    (b"<script>fetch('/steal')</script>", "script"),
    (b"<?php system($_GET['c']); ?>", "php"),
    (b"%PDF-1.7\n1 0 obj<<>>endobj", "PDF"),
])
def test_images_carrying_documents_are_refused_as_polyglots(payload, what, photo):
    with pytest.raises(PolyglotImage) as refused:
        normalise(PHOTOS[photo] + payload, Policy())
    assert refused.value.code == "polyglot_image"


@pytest.mark.parametrize("photo", PHOTOS)
def test_a_polyglot_that_is_also_broken_is_refused_as_a_polyglot(photo):
    """The search for a document decides, before the decoder sees the pixels."""
    broken = PHOTOS[photo][:len(PHOTOS[photo]) // 2]
    with pytest.raises(PolyglotImage):
        normalise(broken + b"<script>fetch('/steal')</script>", Policy())


@pytest.mark.parametrize("photo", PHOTOS)
def test_a_refused_polyglot_leaves_no_fingerprint_behind(photo):
    """A large photo's search for documents runs beside its decode: the verdict still comes
    before the picture is fingerprinted, so a refused picture is not remembered."""
    index = FingerprintIndex()
    with pytest.raises(PolyglotImage):
        normalise(PHOTOS[photo] + b"<script>fetch('/steal')</script>", Policy(), index=index)
    assert len(index) == 0
    normalise(PHOTOS[photo], Policy(), index=index)
    assert len(index) == 1


def test_a_polyglot_over_the_size_limit_is_refused_as_a_polyglot():
    with pytest.raises(PolyglotImage):
        normalise(PHOTOS["downscaled"] + b"%PDF-1.7\n1 0 obj<<>>endobj", Policy(max_input_pixels=1_000_000))


# Pieces of payloads, whole and broken, in either case, among bytes of every value.
_PIECES = st.sampled_from([b"<script", b"<SCRIPT>", b"<ScRiPt ", b"<html>", b"<htm", b"<?php\n", b"<?PHP",
                           b"<iframe\t", b"<object>", b"<objec", b"%PDF-1.7", b"%pdf-1.", b"%PDF-x.1", b"<", b"%",
                           b">", b" ", b"\x00\xff"])


@settings(deadline=None)  # a pause of the loaded machine is not a slow search
@given(st.lists(st.one_of(_PIECES, st.binary(max_size=8)), max_size=40).map(b"".join))
def test_the_search_for_documents_finds_what_the_case_blind_pattern_finds(region):
    found, expected = _payload(region), _PAYLOAD.search(region)
    assert (found and (found.start(), found.group(0))) == (expected and (expected.start(), expected.group(0)))


def test_an_image_with_a_zip_archive_appended_is_refused():
    zipped = io.BytesIO()
    import zipfile

    with zipfile.ZipFile(zipped, "w") as archive:
        archive.writestr("payload.txt", "hidden")
    with pytest.raises(PolyglotImage, match="ZIP"):
        normalise(JPEG + zipped.getvalue(), Policy())


@pytest.mark.parametrize("svg", [
    b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
    b'<?xml version="1.0"?>\n<!-- a drawing -->\n<svg xmlns="http://www.w3.org/2000/svg"/>',
    b"  <!DOCTYPE svg PUBLIC '-//W3C//DTD SVG 1.1//EN' 'x'><svg/>",
])
def test_svg_is_refused_with_a_clear_reason(svg):
    with pytest.raises(UnsupportedFormat, match="SVG"):
        normalise(svg, Policy())


def test_a_policy_that_allows_only_png_refuses_a_jpeg_and_says_so():
    with pytest.raises(UnsupportedFormat, match="JPEG is not allowed here"):
        normalise(JPEG, Policy(allowed_formats=("PNG",)))


def test_formats_outside_the_supported_set_are_never_opened():
    for fmt in ("ICO", "PCX", "TGA", "PPM"):
        buffer = io.BytesIO()
        Image.new("RGB", (16, 16)).save(buffer, fmt)
        with pytest.raises(UnsupportedFormat):
            normalise(buffer.getvalue(), Policy())


def test_a_twelve_megapixel_jpeg_is_decoded_at_half_scale_for_a_one_megapixel_target(monkeypatch):
    from controlplane.imaging import decode, resample, rows

    decoded = []
    original = decode.simplejpeg.decode_jpeg

    def spy(*args, **kwargs):
        pixels = original(*args, **kwargs)
        decoded.append(pixels.shape[1::-1])
        return pixels

    class Bands(resample.Bands):  # the decoded picture, where the resample runs behind the decode
        def __init__(self, pixels, width, height, size):
            decoded.append((width, height))
            super().__init__(pixels, width, height, size)

    monkeypatch.setattr(decode.simplejpeg, "decode_jpeg", spy)
    monkeypatch.setattr(rows, "Bands", Bands)
    result = normalise(image_bytes(4000, 3000, "JPEG"), Policy(max_pixels=1_003_520))
    assert decoded == [(2000, 1500)]  # DCT-domain scaling: never the full 12 MP
    assert result.width * result.height <= 1_003_520


def test_a_cmyk_jpeg_is_decoded_by_pillow_and_turned_rgb():
    buffer = io.BytesIO()
    Image.new("CMYK", (640, 480), (0, 120, 200, 10)).save(buffer, "JPEG")
    result = normalise(buffer.getvalue(), Policy(max_pixels=100_000))
    assert result.width * result.height <= 100_000 and Image.open(io.BytesIO(result.data)).mode == "RGB"


def test_heif_and_avif_are_decoded():
    pillow_heif = pytest.importorskip("pillow_heif")
    pillow_heif.register_heif_opener()
    for fmt in ("HEIF", "AVIF"):
        buffer = io.BytesIO()
        Image.new("RGB", (640, 480), (10, 120, 200)).save(buffer, fmt, quality=80)
        result = normalise(buffer.getvalue(), Policy())
        assert (result.source_format, result.width, result.height) == (fmt, 640, 480)


def test_a_png_whose_pixel_data_is_corrupt_is_refused_not_served_black():
    """Its orientation is read from its header: looking for an eXIf chunk past the pixels once
    decoded them, and the decode's failure was taken for a broken EXIF block."""
    from tests.imaging_corpus import png_claiming

    with pytest.raises(CorruptImage):
        normalise(png_claiming(300, 200), Policy())
