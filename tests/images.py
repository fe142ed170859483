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
