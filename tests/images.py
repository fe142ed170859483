"""Images made in the tests themselves: nothing is downloaded."""

import base64
import io

from PIL import Image, ImageDraw


def image_bytes(width, height, fmt="JPEG", mode="RGB", color=(180, 40, 30), **save):
    buffer = io.BytesIO()
    image = Image.new(mode, (width, height), color if mode == "RGB" else None)
    if mode != "RGB":
        image = Image.new(mode, (width, height))
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def noise_bytes(width, height, fmt="PNG", **save) -> bytes:
    """A picture of noise: it compresses hardly at all (900x600 as a PNG: over a megabyte)."""
    buffer = io.BytesIO()
    Image.effect_noise((width, height), 90).convert("RGB").save(buffer, fmt, **save)
    return buffer.getvalue()


def data_url(data: bytes, mime="image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def serve_files(files: dict[str, tuple[bytes, str]]):
    """A real HTTP server on 127.0.0.1 serving `files` (path -> (body, content type))."""
    import contextlib
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body, kind = files.get(self.path, (b"missing", "text/plain"))
            self.send_response(200 if self.path in files else 404)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    @contextlib.contextmanager
    def running():
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()

    return running()


def picture(seed: int) -> Image.Image:
    """A photo-like picture of rectangles and ellipses, different for each `seed`."""
    image = Image.new("RGB", (640 + seed * 23, 480 - seed * 7), ((seed * 47) % 255, 90, 160))
    draw = ImageDraw.Draw(image)
    for k in range(25):
        x, y = (k * 97 + seed * 31) % image.width, (k * 53 + seed * 17) % image.height
        draw.rectangle([x, y, x + 60 + k * 3, y + 30 + seed], fill=((k * 40) % 255, (seed * 60) % 255, (k * seed) % 255))
        draw.ellipse([y % 300, x % 200, y % 300 + 50, x % 200 + 40], fill=(k * 9 % 255, 200, 40))
    return image
