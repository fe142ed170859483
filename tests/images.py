"""Images made in the tests themselves: nothing is downloaded."""

import base64
import io

from PIL import Image


def image_bytes(width, height, fmt="JPEG", mode="RGB", color=(180, 40, 30), **save):
    buffer = io.BytesIO()
    image = Image.new(mode, (width, height), color if mode == "RGB" else None)
    if mode != "RGB":
        image = Image.new(mode, (width, height))
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def data_url(data: bytes, mime="image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
