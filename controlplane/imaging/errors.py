class ImageError(ValueError):
    """An image that cannot be accepted. `code` is stable and machine readable."""

    code = "invalid_image"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidDataURL(ImageError):
    code = "invalid_image_url"


class UnsupportedFormat(ImageError):
    code = "unsupported_image_format"


class ImageTooLarge(ImageError):
    code = "image_too_large"


class ImageTooComplex(ImageError):
    """Within every size bound, but more work to decode than a picture may take."""

    code = "image_too_complex"


class CorruptImage(ImageError):
    code = "corrupt_image"


class PolicyViolation(ImageError):
    code = "image_policy_violation"
