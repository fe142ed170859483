import io

import pytest
from PIL import Image

from controlplane.imaging.synthetic import COLOURS, TASKS, generate


def _image(sample):
    return Image.open(io.BytesIO(sample.image)).convert("RGB")


def _components(image, ink):
    """Connected regions of pixels of exactly the colour `ink`."""
    w, h = image.size
    pixels = image.load()
    seen, regions = set(), 0
    for y in range(h):
        for x in range(w):
            if (x, y) in seen or pixels[x, y] != ink:
                continue
            regions += 1
            stack = [(x, y)]
            seen.add((x, y))
            while stack:
                cx, cy = stack.pop()
                for nx, ny in ((cx + 1, cy), (cx - 1, cy), (cx, cy + 1), (cx, cy - 1)):
                    if 0 <= nx < w and 0 <= ny < h and (nx, ny) not in seen \
                            and pixels[nx, ny] == ink:
                        seen.add((nx, ny))
                        stack.append((nx, ny))
    return regions


@pytest.mark.parametrize("task", TASKS)
def test_it_draws_the_same_samples_from_the_same_seed(task):
    first = generate(task, 6, seed=3)
    assert generate(task, 6, seed=3) == first
    assert generate(task, 3, seed=3) == first[:3]
    assert [s.image for s in generate(task, 6, seed=4)] != [s.image for s in first]


@pytest.mark.parametrize("style", ["plain", "varied"])
@pytest.mark.parametrize("task", TASKS)
def test_every_sample_is_a_png_of_its_stated_size_with_an_answer(task, style):
    for sample in generate(task, 12, seed=1, style=style, content="mixed"):
        image = Image.open(io.BytesIO(sample.image))
        assert image.format == "PNG"
        assert image.size == (sample.width, sample.height)
        assert sample.task == task and sample.question.endswith("?")
        assert sample.answers and all(sample.answers)


def test_plain_numbers_are_drawn_where_their_characters_are_said_to_be():
    for sample in generate("read", 20, seed=2, style="plain", content="mixed"):
        image = _image(sample)
        items = sample.meta["items"]
        assert "".join(item[0] for item in items) == sample.answers[0]
        pixels = image.load()
        inked = {(x, y) for y in range(image.height) for x in range(image.width)
                 if pixels[x, y] != (255, 255, 255)}
        boxes = [item[1:] for item in items]
        assert inked and all(any(b[0] - 1 <= x <= b[2] and b[1] - 1 <= y <= b[3] for b in boxes)
                             for x, y in inked)
        assert all(any(b[0] <= x < b[2] and b[1] <= y < b[3] for x, y in inked) for b in boxes)


def test_varied_reading_spans_glyphs_from_barely_legible_to_large():
    sizes = [s.meta["font_size"] for s in generate("read", 200, seed=0)]
    assert min(sizes) <= 11 and max(sizes) >= 36


def test_the_count_is_the_number_of_marks_drawn():
    for sample in generate("count", 20, seed=5, style="plain"):
        assert _components(_image(sample), (0, 0, 0)) == int(sample.answers[0])
        assert sample.answers[1] in ("one", "two", "three", "four", "five", "six", "seven",
                                     "eight", "nine")
    for sample in generate("count", 20, seed=5):
        asked = [item for item in sample.meta["items"] if item[0] == sample.meta["shape"]]
        assert len(asked) == int(sample.answers[0])


def test_presence_asks_half_about_objects_drawn_and_half_about_absent_ones():
    samples = generate("presence", 100, seed=7)
    assert sum(s.answers == ("yes",) for s in samples) == 50
    for sample in samples:
        drawn = {item[0] for item in sample.meta["items"]}
        assert (sample.meta["object"] in drawn) == (sample.answers[0] == "yes")
        assert sample.meta["object"] in sample.question
        image = _image(sample)
        for label, *box in sample.meta["items"]:
            crop = image.crop(box)
            assert COLOURS[label.split()[0]] in {c for _, c in crop.getcolors(box[2] * box[3])}


def test_adversarial_absent_objects_share_a_colour_or_a_shape_with_one_drawn():
    for sample in generate("presence", 40, seed=1, negatives="adversarial"):
        if sample.answers[0] == "no":
            colour, shape = sample.meta["object"].split()
            drawn = [item[0].split() for item in sample.meta["items"]]
            assert any(colour == c or shape == s for c, s in drawn)


def test_the_chart_answer_is_the_value_printed_for_the_label_asked():
    for sample in generate("chart", 20, seed=3):
        label = sample.question.rstrip("?").split()[-1]
        assert sample.answers[0] == str(sample.meta["values"][label])
        printed = "".join(item[0] for item in sample.meta["items"])
        assert sample.answers[0] in printed


def test_long_images_are_strips_of_one_to_six_to_one_to_fifteen():
    for sample in generate("long", 20, seed=4):
        long, short = max(sample.width, sample.height), min(sample.width, sample.height)
        assert 6 * short - 1 <= long <= 15 * short + 1
        assert sample.answers[0] in "".join(item[0] for item in sample.meta["items"])


def test_long_strips_take_the_ratio_range_asked_for():
    for sample in generate("long", 10, seed=4, style="plain", strip="banner", ratio=(15, 30)):
        assert 15 * sample.height - 1 <= sample.width <= 30 * sample.height + 1
    # The default range draws the strips it drew before the range could be asked for.
    assert generate("long", 3, seed=4, ratio=(6, 15)) == generate("long", 3, seed=4)


def test_pillow_font_alone_is_accepted():
    assert generate("read", 3, seed=0, fonts="default")


@pytest.mark.parametrize("args, options, message", [
    (("dance", 1, 0), {}, "unknown task"),
    (("read", -1, 0), {}, "count"),
    (("read", 1, 0), {"style": "fancy"}, "style"),
    (("presence", 1, 0), {"negatives": "some"}, "negatives"),
    (("read", 1, 0), {"width": 10}, "width"),
    (("long", 1, 0), {"ratio": (15, 6)}, "ratio"),
])
def test_bad_arguments_are_refused_with_a_clear_error(args, options, message):
    with pytest.raises(ValueError, match=message):
        generate(*args, **options)


def test_banners_can_be_asked_for_as_tall_as_a_canvas_with_the_read_tasks_type():
    for sample in generate("long", 6, 11, style="plain", strip="banner", height=224):
        assert sample.height == 224 and 6 <= sample.width / sample.height <= 15
        assert sample.meta["orientation"] == "wide" and sample.meta["font_size"] == 30
        assert sample.question == "What number is written in the image?"
    receipts = generate("long", 4, 11, strip="receipt")
    assert all(s.meta["orientation"] == "tall" for s in receipts)
    with pytest.raises(ValueError):
        generate("long", 1, 11, strip="scroll")
