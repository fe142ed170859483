"""Labelled visual questions drawn from a seed: numbers and words to read, marks to count,
coloured shapes to find, bar charts and tables, long receipt strips. Pure (stdlib and Pillow).

`generate(task, count, seed)` is deterministic for a seed, a Pillow build and a set of fonts;
with `fonts="default"` only Pillow's bundled font is used, the same on every machine. Sample i
depends only on (task, seed, i, options), so a shorter set is a prefix of a longer one.

Styles: "plain" is black on white in one font, glyphs centred in the 28-pixel cells that
Qwen2.5-VL merges into one image token (easy to learn); "varied" (the default) varies fonts,
sizes down to the legibility limit, positions, colours and backgrounds, so that accuracy
falls gradually as an image is downscaled. `meta["items"]` lists what was drawn where, as
[label, x0, y0, x1, y1] boxes.
"""

from __future__ import annotations

import functools
import io
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

TASKS = ("read", "count", "presence", "chart", "long")
STYLES = ("plain", "varied")
CELL = 28  # pixels per merged image token (patch 14, merge 2)
FONT_DIRS = ("/usr/share/fonts",)

COLOURS = {
    "red": (215, 35, 35), "green": (35, 150, 55), "blue": (35, 70, 215),
    "yellow": (235, 195, 0), "purple": (135, 50, 170), "orange": (240, 125, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
WORDS = ("cat", "dog", "sun", "map", "red", "box", "car", "tree", "blue", "fish", "milk", "book",
         "door", "lamp", "rain", "star", "tea", "bus", "pen", "cup", "hat", "key", "owl", "sky")
BAR_LABELS = "ABCDEF"
_FILLER = ("BREAD", "MILK", "EGGS", "TEA", "RICE", "SOAP", "APPLES", "BEANS", "SALT", "JAM")


@dataclass(frozen=True)
class Sample:
    image: bytes  # PNG
    width: int
    height: int
    question: str
    answers: tuple[str, ...]  # accepted answers, the first canonical
    task: str
    meta: dict


def generate(task: str, count: int, seed: int, *, style: str = "varied", fonts: str = "all",
             width: int = 224, height: int = 224, content: str = "number",
             negatives: str = "mixed", strip: str = "mixed",
             ratio: tuple[float, float] = (6, 15)) -> list[Sample]:
    """`count` samples of `task`. Options: `style` ("plain" or "varied"); `fonts` ("all":
    Pillow's font and the TrueType fonts under /usr/share/fonts, or "default"); the canvas
    `width` and `height` (all tasks but "long", whose strips are 1:`ratio`, by default 1:6 to
    1:15, drawn uniformly between the two); for "read",
    `content` ("number", "word" or "mixed"); for "presence", `negatives` ("random",
    "adversarial": an absent object sharing a colour or shape with a present one, or "mixed");
    for "long", `strip` ("receipt": tall receipt strips; "banner": wide banners `height`
    pixels tall, the number in the read task's type; or "mixed": either, banners 56 pixels
    tall)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if not isinstance(count, int) or count < 0:
        raise ValueError("count must be a non-negative integer")
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}")
    if fonts not in ("all", "default"):
        raise ValueError("fonts must be 'all' or 'default'")
    if content not in ("number", "word", "mixed"):
        raise ValueError("content must be 'number', 'word' or 'mixed'")
    if negatives not in ("random", "adversarial", "mixed"):
        raise ValueError("negatives must be 'random', 'adversarial' or 'mixed'")
    if strip not in ("receipt", "banner", "mixed"):
        raise ValueError("strip must be 'receipt', 'banner' or 'mixed'")
    if not 1 <= ratio[0] <= ratio[1] <= 100:
        raise ValueError("ratio must be (low, high) with 1 <= low <= high <= 100")
    if not (56 <= width <= 4096 and 56 <= height <= 4096):
        raise ValueError("width and height must lie between 56 and 4096 pixels")
    draw = {"read": _read, "count": _count, "presence": _presence, "chart": _chart,
            "long": _long}[task]
    options = {"style": style, "fonts": fonts, "width": width, "height": height,
               "content": content, "negatives": negatives, "strip": strip, "ratio": ratio}
    samples = []
    for i in range(count):
        rng = random.Random(f"{task}:{seed}:{i}")
        if task == "presence":  # balanced as POPE: one of each pair asks about an absent object
            pair = random.Random(f"{task}:{seed}:pair:{i // 2}").random() < 0.5
            options["present"] = pair == (i % 2 == 0)
        image, question, answers, meta = draw(rng, options)
        meta = {"style": style, **meta}
        samples.append(Sample(_png(image), image.width, image.height, question, answers, task,
                              meta))
    return samples


# Fonts and colours


@functools.cache
def system_fonts() -> tuple[str, ...]:
    """TrueType and OpenType fonts found on this machine, in a stable order."""
    found = []
    for root in FONT_DIRS:
        if Path(root).is_dir():
            found += [str(p) for p in Path(root).rglob("*") if p.suffix.lower() in (".ttf", ".otf")
                      and "math" not in p.name.lower()]
    return tuple(sorted(found))


@functools.lru_cache(maxsize=512)
def _font(name: str, size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    if name != "default":
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            pass
    return ImageFont.load_default(size=size)


def _font_name(rng: random.Random, options: dict) -> str:
    names = ["default"]
    if options["fonts"] == "all" and options["style"] == "varied":
        names += list(system_fonts())
    return rng.choice(names)


def _fitting_font(name: str, size: int, text: str, room: int):
    """The font at `size`, or smaller until `text` fits in `room` pixels."""
    font = _font(name, size)
    while font.getlength(text) > room and size > 6:
        size -= 1
        font = _font(name, size)
    return font, size


def _luminance(rgb) -> float:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]


def _palette(rng: random.Random, options: dict, light_only: bool = False):
    """(background, ink) with enough contrast to read."""
    if options["style"] == "plain":
        return (255, 255, 255), (0, 0, 0)
    while True:
        if light_only or rng.random() < 0.75:
            background = tuple(rng.randint(200, 255) for _ in range(3))
        else:
            background = tuple(rng.randint(0, 70) for _ in range(3))
        ink = tuple(rng.randint(0, 255) for _ in range(3))
        if abs(_luminance(background) - _luminance(ink)) >= 110:
            return background, ink


def _canvas(rng: random.Random, options: dict, size, background) -> Image.Image:
    image = Image.new("RGB", size, background)
    if options["style"] == "varied" and rng.random() < 0.3:  # faint ruled or squared paper
        draw = ImageDraw.Draw(image)
        step = rng.randint(10, 30)
        line = tuple(max(0, min(255, c + rng.choice((-25, 25)))) for c in background)
        for y in range(step, size[1], step):
            draw.line([(0, y), (size[0], y)], fill=line)
        if rng.random() < 0.5:
            for x in range(step, size[0], step):
                draw.line([(x, 0), (x, size[1])], fill=line)
    return image


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _text(draw: ImageDraw.ImageDraw, xy, text: str, font, ink) -> list:
    """Draw `text` with its top-left ink at `xy`; one [char, box] item per character."""
    x, y = xy
    left, top, _, _ = font.getbbox(text)
    items = []
    for i, ch in enumerate(text):
        start = font.getlength(text[:i])
        box = font.getbbox(ch)
        if ch != " ":
            items.append([ch, round(x - left + start + box[0]), round(y - top + box[1]),
                          round(x - left + start + box[2]), round(y - top + box[3])])
    draw.text((x - left, y - top), text, font=font, fill=ink)
    return items


# Tasks


def _read(rng: random.Random, options: dict):
    word = options["content"] == "word" or (options["content"] == "mixed" and rng.random() < 0.5)
    if word:
        text = rng.choice(WORDS)
        if options["style"] == "varied" and rng.random() < 0.3:
            text = text.upper()
    else:
        digits = rng.randint(1, 4)
        text = str(rng.randint(10 ** (digits - 1) if digits > 1 else 1, 10 ** digits - 1))
    w, h = options["width"], options["height"]
    background, ink = _palette(rng, options)
    image = _canvas(rng, options, (w, h), background)
    draw = ImageDraw.Draw(image)
    if options["style"] == "plain":
        items, size = _in_cells(rng, draw, text, (w, h), ink), 30
    else:
        size = round(2 ** rng.uniform(3.2, 5.4))  # 9 to 42 pixel fonts, more of the small ones
        font, size = _fitting_font(_font_name(rng, options), size, text, w - 6)
        left, top, right, bottom = font.getbbox(text)
        x = rng.randint(2, max(2, w - 2 - (right - left)))
        y = rng.randint(2, max(2, h - 2 - (bottom - top)))
        items = _text(draw, (x, y), text, font, ink)
    question = f"What {'word' if word else 'number'} is written in the image?"
    return image, question, (text.lower(),), {"text": text, "font_size": size, "items": items}


def _in_cells(rng: random.Random, draw: ImageDraw.ImageDraw, text: str, size, ink) -> list:
    """The plain style's text: 30-pixel glyphs, each centred in its own token cell, along a
    row and from a column drawn at random."""
    font = _font("default", 30)
    cols, rows = size[0] // CELL, size[1] // CELL
    if len(text) > cols:
        raise ValueError("the canvas is too narrow for the text")
    row, col = rng.randrange(rows), rng.randint(0, cols - len(text))
    items = []
    for k, ch in enumerate(text):
        left, top, right, bottom = font.getbbox(ch)
        x = (col + k) * CELL + (CELL - (right - left)) // 2
        y = row * CELL + (CELL - (bottom - top)) // 2
        items += _text(draw, (x, y), ch, font, ink)
    return items


def _shape(draw: ImageDraw.ImageDraw, shape: str, box, fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, (y0 + y1) / 2), ((x0 + x1) / 2, y1),
                      (x0, (y0 + y1) / 2)], fill=fill)


def _place(rng: random.Random, w: int, h: int, sizes: list[int], margin: int = 3) -> list:
    """Non-overlapping boxes of the given sizes, or fewer when the canvas is full."""
    boxes = []
    for size in sizes:
        for _ in range(200):
            x, y = rng.randint(2, w - size - 2), rng.randint(2, h - size - 2)
            box = (x, y, x + size, y + size)
            if all(box[0] >= b[2] + margin or b[0] >= box[2] + margin or box[1] >= b[3] + margin
                   or b[1] >= box[3] + margin for b in boxes):
                boxes.append(box)
                break
    return boxes


def _count(rng: random.Random, options: dict):
    n = rng.randint(1, 9)
    w, h = options["width"], options["height"]
    if options["style"] == "plain":
        shape, others = "square", []
        cells = rng.sample([(c, r) for c in range(w // CELL) for r in range(h // CELL)], n)
        boxes = [(c * CELL + 7, r * CELL + 7, c * CELL + 21, r * CELL + 21) for c, r in cells]
        background, ink, other_ink = (255, 255, 255), (0, 0, 0), None
    else:
        shape = rng.choice(SHAPES[:3])
        others = [rng.choice([s for s in SHAPES if s != shape])] * rng.choice((0, 0, 1, 2, 3))
        sizes = [rng.randint(7, 22) for _ in range(n + len(others))]
        boxes = _place(rng, w, h, sizes)
        if len(boxes) < n + len(others):
            raise ValueError("the canvas is too small for the marks")
        background, ink = _palette(rng, options)
        other_ink = ink if rng.random() < 0.5 else _palette(rng, options)[1]
    image = _canvas(rng, options, (w, h), background)
    draw = ImageDraw.Draw(image)
    items = []
    for k, box in enumerate(boxes):
        kind, fill = (shape, ink) if k < n else (others[k - n], other_ink)
        _shape(draw, kind, box, fill)
        items.append([kind, *box])
    return (image, f"How many {shape}s are there?", (str(n), NUMBER_WORDS[n]),
            {"shape": shape, "count": n, "items": items})


def _presence(rng: random.Random, options: dict):
    w, h = options["width"], options["height"]
    everything = [(c, s) for c in COLOURS for s in SHAPES]
    drawn = rng.sample(everything, rng.randint(1, 4))
    if options["style"] == "plain":
        cells = rng.sample([(c, r) for c in range(w // CELL) for r in range(h // CELL)],
                           len(drawn))
        boxes = [(c * CELL + 3, r * CELL + 3, c * CELL + 25, r * CELL + 25) for c, r in cells]
    else:
        boxes = _place(rng, w, h, [rng.randint(12, 40) for _ in drawn], margin=4)
        drawn = drawn[:len(boxes)]
    background = _palette(rng, options, light_only=True)[0]
    background = tuple(min(255, max(c, 215)) for c in background)  # keep the colours true
    image = _canvas(rng, options, (w, h), background)
    draw = ImageDraw.Draw(image)
    items = []
    for (colour, shape), box in zip(drawn, boxes, strict=True):
        _shape(draw, shape, box, COLOURS[colour])
        items.append([f"{colour} {shape}", *box])
    meta = {"items": items}
    if options["present"]:
        colour, shape = rng.choice(drawn)
    else:
        absent = [o for o in everything if o not in drawn]
        kind = options["negatives"]
        if kind == "mixed":
            kind = rng.choice(("random", "adversarial"))
        if kind == "adversarial":
            absent = [o for o in absent if any(o[0] == d[0] or o[1] == d[1] for d in drawn)]
        colour, shape = rng.choice(absent)
        meta["negative"] = kind
    meta["object"] = f"{colour} {shape}"
    answer = "yes" if options["present"] else "no"
    article = "an" if colour[0] in "aeiou" else "a"
    return image, f"Is there {article} {colour} {shape} in the image?", (answer,), meta


def _chart(rng: random.Random, options: dict):
    w, h = options["width"], options["height"]
    n = rng.randint(3, 5)
    labels = BAR_LABELS[:n]
    values = [rng.randint(1, 99) for _ in labels]
    asked = rng.randrange(n)
    background, ink = _palette(rng, options, light_only=True)
    image = _canvas(rng, options, (w, h), background)
    draw = ImageDraw.Draw(image)
    size = 14 if options["style"] == "plain" else rng.randint(9, 18)
    font = _font(_font_name(rng, options), size)
    items = []
    table = options["style"] == "varied" and rng.random() < 0.35
    if table:
        row = (h - 8) // n
        for k, (label, value) in enumerate(zip(labels, values, strict=True)):
            y = 4 + k * row + max(0, (row - size) // 2)
            items += _text(draw, (w // 6, y), label, font, ink)
            items += _text(draw, (w // 2, y), str(value), font, ink)
            draw.line([(4, 4 + (k + 1) * row - 1), (w - 4, 4 + (k + 1) * row - 1)], fill=ink)
        question = f"What is the value in row {labels[asked]}?"
    else:
        top, bottom = size + 8, h - size - 8
        slot = (w - 8) // n
        bar = tuple(rng.randint(0, 200) for _ in range(3)) if options["style"] == "varied" \
            else (90, 90, 90)
        for k, (label, value) in enumerate(zip(labels, values, strict=True)):
            x0 = 4 + k * slot + slot // 5
            x1 = 4 + (k + 1) * slot - slot // 5
            y0 = bottom - round((bottom - top) * value / 100)
            draw.rectangle((x0, y0, x1, bottom), fill=bar)
            text_w = font.getlength(str(value))
            items += _text(draw, ((x0 + x1 - text_w) / 2, y0 - size - 2), str(value), font, ink)
            items += _text(draw, ((x0 + x1 - font.getlength(label)) / 2, bottom + 4), label,
                           font, ink)
        question = f"What is the value of bar {labels[asked]}?"
    return (image, question, (str(values[asked]),),
            {"kind": "table" if table else "bar", "values": dict(zip(labels, values, strict=True)),
             "font_size": size, "items": items})


def _long(rng: random.Random, options: dict):
    ratio = rng.uniform(*options["ratio"])
    total = str(rng.randint(1, 9999))
    background, ink = _palette(rng, options, light_only=True)
    receipt = rng.random() < 0.5
    if options["strip"] != "mixed":
        receipt = options["strip"] == "receipt"
    if receipt:  # a tall receipt strip: find the total among the priced lines
        w = 112
        h = round(w * ratio)
        size = 12 if options["style"] == "plain" else rng.randint(10, 16)
        font, size = _fitting_font(_font_name(rng, options), size, "TOTAL 9999", w - 8)
        image = _canvas(rng, options, (w, h), background)
        draw = ImageDraw.Draw(image)
        lines = (h - 8) // (size + 6)
        at = rng.randrange(lines)
        items = []
        for k in range(lines):
            y = 4 + k * (size + 6)
            if k == at:
                items += _text(draw, (4, y), f"TOTAL {total}", font, ink)
            else:
                _text(draw, (4, y), f"{rng.choice(_FILLER)} {rng.randint(1, 99)}", font, ink)
        question, orientation = "What is the total on the receipt?", "tall"
    else:  # a wide banner with one number somewhere along it
        h = options["height"] if options["strip"] == "banner" else 56
        w = round(h * ratio)
        image = _canvas(rng, options, (w, h), background)
        draw = ImageDraw.Draw(image)
        if options["style"] == "plain":  # as the read task draws it
            items, size = _in_cells(rng, draw, total, (w, h), ink), 30
        else:
            font, size = _fitting_font(_font_name(rng, options), rng.randint(12, 40), total, w - 6)
            left, top, right, bottom = font.getbbox(total)
            x = rng.randint(2, w - 2 - (right - left))
            y = rng.randint(2, max(2, h - 2 - (bottom - top)))
            items = _text(draw, (x, y), total, font, ink)
        question, orientation = "What number is written in the image?", "wide"
    return (image, question, (total,),
            {"orientation": orientation, "ratio": round(ratio, 2), "font_size": size,
             "items": items})
