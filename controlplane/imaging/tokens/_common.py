"""Small helpers shared by the per-family counters."""

from __future__ import annotations


def check_sides(width: int, height: int) -> None:
    if width <= 0 or height <= 0:
        raise ValueError("image sides must be positive")


def edge(value: int | dict | None, key: str, default: int) -> int:
    """An HF size option given either as its dict (`{"longest_edge": 1024}`) or as a bare int."""
    if value is None:
        return default
    if isinstance(value, dict):
        if key in value:
            return int(value[key])
        if "height" in value and "width" in value and value["height"] == value["width"]:
            return int(value["height"])
        raise ValueError(f"size option {value!r} has no {key!r}")
    return int(value)


def square(value: int | dict | None, default: int) -> int:
    """A square tile size given as `{"height": n, "width": n}` or as a bare int."""
    if value is None:
        return default
    if isinstance(value, dict):
        if value.get("height") != value.get("width"):
            raise ValueError(f"only square tiles are supported, got {value!r}")
        return int(value["height"])
    return int(value)
