"""count_image_tokens against transformers' own processors (transformers 4.57.6, no torch).

Two levels, for every family except phi3_v:

* size-only, thousands of seeded random sizes per family (tiny, huge, very wide, very tall
  and everything between), with the processors' size-only methods
  (`_get_num_multimodal_tokens`, `get_number_of_image_patches`, `pan_and_scan`) or, where
  transformers has no exact size-only path (Idefics3), its real resize/split methods run on
  pixel-free arrays;
* full pipeline, a few dozen sizes per family including the extremes: the real processor
  class, built from the canonical checkpoint's processor settings, gets a prompt with the
  image placeholder and a real PIL image; the image-related ids in `input_ids` are counted.
  The tokenizer is a tiny in-memory WordLevel one holding the special tokens the processor
  needs (no download), so the only thing in the prompt besides two plain words is what the
  processor wrote for the image. Where the real tokenizer has a single token for "\\n\\n"
  (Gemma, Llama 3), the tiny one does too.

Shims, all test-only: the Qwen and InternVL processors require a video processor, which
needs torchvision; a subclass skips that one type check and gets a placeholder (no video is
processed). Images are passed with `input_data_format="channels_last"`, because
transformers otherwise guesses channels-first for an image 1 or 3 pixels high.

Not compared with a running processor:
* phi3_v: its processor is remote code (microsoft/Phi-3.5-vision-instruct), not part of
  transformers and not downloadable here; see the phi3_v tests below for what checks it.
* Gemma 3 pan-and-scan: the prose the processor adds around crops ("Here is the original
  image ...") depends on the real Gemma tokenizer; only the crop count and the image tokens
  are compared, the prose estimate is not.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import warnings

import pytest

transformers = pytest.importorskip("transformers")
np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # noqa: E402

from controlplane.imaging.tokens import (  # noqa: E402
    count_image_tokens,
    gemma3_num_crops,
    phi3_v_hd_size,
)

logging.getLogger("transformers").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module="transformers")

SIZE_ONLY_SAMPLES = 3000


# --------------------------------------------------------------------------- sizes


def _side(rng: random.Random, top: int) -> int:
    return max(1, int(round(math.exp(rng.uniform(0, math.log(top))))))


def random_sizes(seed, n: int, *, top: int = 8000) -> list[tuple[int, int]]:
    """Seeded (width, height) pairs: log-uniform sides, near-squares and extreme strips."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(n):
        pick = rng.random()
        if pick < 0.55:
            w, h = _side(rng, top), _side(rng, top)
        elif pick < 0.75:
            w = _side(rng, top)
            h = max(1, int(w * rng.uniform(0.7, 1.4)))
        else:
            short, long = _side(rng, 400), _side(rng, top)
            w, h = (long, short) if rng.random() < 0.5 else (short, long)
        sizes.append((w, h))
    return sizes


EXTREMES = [
    (1, 1), (2, 2), (5, 7), (14, 14), (28, 28), (29, 27), (100, 100), (336, 336), (448, 448),
    (640, 480), (1024, 1024), (1280, 720), (1920, 1080), (1080, 1920), (2000, 30),
    (30, 2000), (3000, 200), (200, 3000), (4000, 3000), (5000, 100), (100, 5000),
]


def full_sizes(seed, n: int = 14, *, top: int = 2400) -> list[tuple[int, int]]:
    """The fixed extremes plus a few random sizes, kept moderate so the pixels stay cheap."""
    return EXTREMES + random_sizes(seed, n, top=top)


def mismatches(pairs):
    """[(size, ours, theirs)] where the two counts differ; reported in full on failure."""
    return [(size, ours, theirs) for size, ours, theirs in pairs if ours != theirs]


# --------------------------------------------------------------------------- tiny tokenizer


def tiny_tokenizer(special, *, extra=None, plain=(), cls=None):
    """A WordLevel tokenizer that knows 'hello', 'world' and the given tokens, nothing else."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cls = cls or transformers.PreTrainedTokenizerFast
    tok = cls(tokenizer_object=backend, unk_token="[UNK]", extra_special_tokens=extra or {})
    if plain:  # e.g. "\n\n": one token in the real tokenizer, so one token here
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain])
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    return tok


def without_video(processor_cls):
    """The processor class, minus its type check on the (torchvision-only) video processor."""

    class NoVideo(processor_cls):
        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor":
                return type(arg)
            return super().check_argument_for_proper_class(name, arg)

    return NoVideo


def prompt_ids(processor, placeholder, width, height, **kwargs):
    """input_ids of 'hello <placeholder> world' with one width x height image."""
    out = processor(
        text=[f"hello {placeholder} world"],
        images=[Image.new("RGB", (width, height), (120, 60, 30))],
        return_tensors="np",
        input_data_format="channels_last",
        **kwargs,
    )
    return np.asarray(out["input_ids"][0])


def run_full(processor, placeholder, image_tokens, width, height, **kwargs) -> int:
    """How many ids of `image_tokens` the processor puts in the prompt for one image."""
    ids = processor.tokenizer.convert_tokens_to_ids(list(image_tokens))
    return int(np.isin(prompt_ids(processor, placeholder, width, height, **kwargs), ids).sum())


# --------------------------------------------------------------------------- Qwen


QWEN_SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
QWEN_IMAGE = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# family -> processor class name, image processor settings of the canonical checkpoint
QWEN = {
    "qwen2_vl": ("Qwen2VLProcessor", {"min_pixels": 3136, "max_pixels": 12845056}),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", {"min_pixels": 3136, "max_pixels": 12845056}),
    # Qwen3-VL ships size {"shortest_edge": 65536, "longest_edge": 16777216} for the fast
    # (torch) image processor; the slow one used here drops a `size` given to __init__
    # (transformers 4.57.6), so the same bounds go in as min_pixels/max_pixels.
    "qwen3_vl": (
        "Qwen3VLProcessor",
        {"min_pixels": 65536, "max_pixels": 16777216, "patch_size": 16},
    ),
}


@functools.cache
def qwen_processor(family):
    name, settings = QWEN[family]
    tok = tiny_tokenizer(QWEN_SPECIAL, cls=transformers.Qwen2TokenizerFast)
    image_processor = transformers.Qwen2VLImageProcessor(**settings)
    cls = without_video(getattr(transformers, name))
    return cls(image_processor=image_processor, tokenizer=tok, video_processor=object())


def qwen_bounds(rng: random.Random, family: str) -> dict:
    unit = 32 if family == "qwen3_vl" else 28
    kind = rng.random()
    if kind < 0.3:
        return {}  # checkpoint defaults
    if kind < 0.5:  # the resolution policy defaults of this project
        return {"min_pixels": 3136, "max_pixels": rng.choice([1003520, 200704])}
    low = rng.randint(1, 64) * unit * unit
    return {"min_pixels": low, "max_pixels": low + rng.randint(0, 4000) * unit * unit}


@pytest.mark.parametrize("family", sorted(QWEN))
def test_qwen_size_only_matches_processor(family):
    processor = qwen_processor(family)
    rng = random.Random(f"qwen-{family}")
    pairs, refused = [], 0
    for width, height in random_sizes(family, SIZE_ONLY_SAMPLES):
        bounds = qwen_bounds(rng, family)
        if max(width, height) / min(width, height) > 200:
            # Both refuse what Qwen-VL cannot take.
            with pytest.raises(ValueError):
                count_image_tokens(family, width, height, **bounds)
            with pytest.raises(ValueError):
                processor._get_num_multimodal_tokens(image_sizes=[(height, width)], **bounds)
            refused += 1
            continue
        theirs = processor._get_num_multimodal_tokens(image_sizes=[(height, width)], **bounds)
        # The processor counts the <|image_pad|> expansion; the two markers come from the
        # chat template's <|vision_start|><|image_pad|><|vision_end|> around it.
        pairs.append(
            ((width, height, bounds), count_image_tokens(family, width, height, **bounds),
             theirs["num_image_tokens"][0] + 2)
        )
    assert refused > 50 and len(pairs) > 2500
    assert mismatches(pairs) == []


@pytest.mark.parametrize("family", sorted(QWEN))
def test_qwen_full_pipeline_matches_count(family):
    processor = qwen_processor(family)
    pairs = []
    for width, height in full_sizes(7):
        if max(width, height) / min(width, height) > 200:
            continue
        # The project's 'high' policy bound keeps the pixels cheap; defaults for a few.
        bounds = {} if width * height < 400_000 else {"min_pixels": 3136, "max_pixels": 1003520}
        theirs = run_full(processor, QWEN_PLACEHOLDER, QWEN_IMAGE, width, height, **bounds)
        pairs.append(((width, height, bounds), count_image_tokens(family, width, height, **bounds), theirs))
    assert len(pairs) >= 30
    assert mismatches(pairs) == []


def test_qwen_processor_options_reach_the_processor_the_same_way():
    # What the gateway does: count with processor_options(...) for a policy.
    from controlplane.imaging.tokens import processor_options

    processor = qwen_processor("qwen2_5_vl")
    options = processor_options("qwen2_5_vl", min_pixels=3136, max_pixels=1003520)
    theirs = run_full(processor, QWEN_PLACEHOLDER, QWEN_IMAGE, 1335, 751, **options)
    assert count_image_tokens("qwen2_5_vl", 1335, 751, **options) == theirs


# --------------------------------------------------------------------------- LLaVA


@functools.cache
def llava_processor():
    tok = tiny_tokenizer(["<image>"], cls=transformers.LlamaTokenizerFast)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
    )
    return transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )


def test_llava_size_only_and_full_pipeline():
    processor = llava_processor()
    sizes = random_sizes(11, 200)
    theirs = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])
    assert {count_image_tokens("llava", w, h) for w, h in sizes} == set(theirs["num_image_tokens"])
    pairs = [
        ((w, h), count_image_tokens("llava", w, h), run_full(processor, "<image>", ["<image>"], w, h))
        for w, h in full_sizes(11, 9)
    ]
    assert mismatches(pairs) == []


LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# A larger anyres set (up to 3x3 crops, as LLaVA-OneVision style checkpoints use).
WIDE_PINPOINTS = [[336 * r, 336 * c] for r in range(1, 4) for c in range(1, 4)]

LLAVA_NEXT_VARIANTS = {
    "llava-v1.6-mistral-7b-hf": ({}, LLAVA_NEXT_PINPOINTS, "default", 1),
    "3x3 grid, full features": (
        {"image_grid_pinpoints": WIDE_PINPOINTS, "vision_feature_select_strategy": "full",
         "num_additional_image_tokens": 0},
        WIDE_PINPOINTS, "full", 0,
    ),
}


@functools.cache
def llava_next_processor(variant):
    _, pinpoints, strategy, additional = LLAVA_NEXT_VARIANTS[variant]
    tok = tiny_tokenizer(["<image>"], cls=transformers.LlamaTokenizerFast)
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
        image_grid_pinpoints=pinpoints,
    )
    return transformers.LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=additional,
    )


@pytest.mark.parametrize("variant", sorted(LLAVA_NEXT_VARIANTS))
def test_llava_next_size_only_matches_processor(variant):
    options = LLAVA_NEXT_VARIANTS[variant][0]
    processor = llava_next_processor(variant)
    sizes = random_sizes(len(variant), SIZE_ONLY_SAMPLES)
    theirs = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])
    pairs = [
        ((w, h), count_image_tokens("llava_next", w, h, **options), t)
        for (w, h), t in zip(sizes, theirs["num_image_tokens"], strict=True)
    ]
    assert mismatches(pairs) == []


@pytest.mark.parametrize("variant", sorted(LLAVA_NEXT_VARIANTS))
def test_llava_next_full_pipeline_matches_count(variant):
    options = LLAVA_NEXT_VARIANTS[variant][0]
    processor = llava_next_processor(variant)
    pairs = [
        ((w, h), count_image_tokens("llava_next", w, h, **options),
         run_full(processor, "<image>", ["<image>"], w, h))
        for w, h in full_sizes(13, 9)
    ]
    assert mismatches(pairs) == []


# --------------------------------------------------------------------------- InternVL


INTERNVL_TOKENS = {
    "start_image_token": "<img>", "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>",
}


@functools.cache
def internvl_processor(min_patches=1, max_patches=12):
    tok = tiny_tokenizer(list(INTERNVL_TOKENS.values()), extra=INTERNVL_TOKENS)
    # OpenGVLab/InternVL3-*-hf preprocessor_config.json; crop_to_patches is switched on by
    # the InternVL processor's defaults.
    image_processor = transformers.GotOcr2ImageProcessor(
        size={"height": 448, "width": 448}, min_patches=min_patches, max_patches=max_patches,
        crop_to_patches=False,
    )
    cls = without_video(transformers.InternVLProcessor)
    return cls(image_processor=image_processor, tokenizer=tok, video_processor=object(),
               image_seq_length=256)


INTERNVL_BOUNDS = [(1, 12), (1, 6), (1, 1), (2, 8), (1, 40)]


@pytest.mark.parametrize("bounds", INTERNVL_BOUNDS, ids=str)
def test_internvl_size_only_matches_processor(bounds):
    low, high = bounds
    processor = internvl_processor(low, high)
    sizes = random_sizes(high, SIZE_ONLY_SAMPLES // 2)
    theirs = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])
    pairs = [
        ((w, h), count_image_tokens("internvl", w, h, min_patches=low, max_patches=high), t)
        for (w, h), t in zip(sizes, theirs["num_image_tokens"], strict=True)
    ]
    assert mismatches(pairs) == []


def test_internvl_full_pipeline_matches_count():
    processor = internvl_processor()
    image = ["<img>", "</img>", "<IMG_CONTEXT>"]
    pairs = [
        ((w, h), count_image_tokens("internvl", w, h), run_full(processor, "<IMG_CONTEXT>", image, w, h))
        for w, h in full_sizes(17, 9, top=1600)
    ]
    assert mismatches(pairs) == []


# --------------------------------------------------------------------------- Gemma 3


GEMMA_TOKENS = {
    "image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
}
GEMMA_IMAGE = ["<image_soft_token>", "<start_of_image>", "<end_of_image>", "\n\n"]


@functools.cache
def gemma3_processor():
    tok = tiny_tokenizer(list(GEMMA_TOKENS.values()), extra=GEMMA_TOKENS, plain=["\n\n", "\n"])
    image_processor = transformers.Gemma3ImageProcessor(size={"height": 896, "width": 896})
    return transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tok,
                                        image_seq_length=256)


def _pas_options(rng):
    return {
        "pan_and_scan_min_crop_size": rng.choice([256, 128, 400]),
        "pan_and_scan_max_num_crops": rng.choice([4, 2, 8]),
        "pan_and_scan_min_ratio_to_activate": rng.choice([1.2, 1.0, 2.0]),
    }


def test_gemma3_size_only_matches_processor():
    processor = gemma3_processor()
    sizes = random_sizes(19, SIZE_ONLY_SAMPLES)
    theirs = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])
    # The processor's size-only count is the soft tokens alone; the count adds
    # "\n\n", <start_of_image>, <end_of_image>, "\n\n".
    pairs = [((w, h), count_image_tokens("gemma3", w, h), t + 4)
             for (w, h), t in zip(sizes, theirs["num_image_tokens"], strict=True)]
    assert mismatches(pairs) == []


def test_gemma3_pan_and_scan_crop_count_matches_image_processor():
    image_processor = gemma3_processor().image_processor
    rng = random.Random("pas")
    pairs = []
    for w, h in random_sizes(23, SIZE_ONLY_SAMPLES):
        options = _pas_options(rng)
        pixels = np.broadcast_to(np.zeros(1, np.uint8), (h, w, 3))  # shape only, no memory
        crops = image_processor.pan_and_scan(pixels, input_data_format="channels_last", **options)
        pairs.append(((w, h, options), gemma3_num_crops(w, h, **options), len(crops)))
    assert mismatches(pairs) == []
    assert sum(1 for _, ours, _ in pairs if ours) > 200  # crops were really exercised


def test_gemma3_full_pipeline_matches_count():
    processor = gemma3_processor()
    pairs = [
        ((w, h), count_image_tokens("gemma3", w, h),
         run_full(processor, "<start_of_image>", GEMMA_IMAGE, w, h))
        for w, h in full_sizes(29, 9)
    ]
    assert mismatches(pairs) == []


def test_gemma3_full_pipeline_with_pan_and_scan_writes_one_image_per_crop():
    processor = gemma3_processor()
    pairs = []
    image_ids = processor.tokenizer.convert_tokens_to_ids(GEMMA_IMAGE)
    for w, h in full_sizes(31, 9):
        crops = gemma3_num_crops(w, h)
        ids = prompt_ids(processor, "<start_of_image>", w, h, do_pan_and_scan=True)
        # Every image and crop is exactly 260 image positions ...
        pairs.append(((w, h, crops), (crops + 1) * 260, int(np.isin(ids, image_ids).sum())))
        # ... and with crops the processor adds 15 words of prose (unknown words, one [UNK]
        # each in the tiny tokenizer). The count's estimate for the real Gemma tokenizer:
        # those words, the two phrase-final spaces and a space between crop images.
        words = int((ids == processor.tokenizer.unk_token_id).sum())
        assert words == (15 if crops else 0)
        ours = count_image_tokens("gemma3", w, h, do_pan_and_scan=True)
        assert ours - (crops + 1) * 260 == (words + 2 + crops - 1 if crops else 0)
    assert any(size[2] for size, _, _ in pairs)
    assert mismatches(pairs) == []


# --------------------------------------------------------------------------- Pixtral


PIXTRAL_VARIANTS = {
    # mistral-community/pixtral-12b
    "pixtral-12b": ({}, {"longest_edge": 1024}, 16, 1),
    # Mistral-Small-3.1 style: 1540 px, 14 px patches merged 2x2
    "longest 1540, merge 2": (
        {"longest_edge": 1540, "patch_size": 14, "spatial_merge_size": 2}, {"longest_edge": 1540}, 14, 2,
    ),
}


@functools.cache
def pixtral_processor(variant):
    _, size, patch, merge = PIXTRAL_VARIANTS[variant]
    tok = tiny_tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"], cls=transformers.LlamaTokenizerFast)
    image_processor = transformers.PixtralImageProcessor(
        size=size, patch_size={"height": patch, "width": patch}
    )
    return transformers.PixtralProcessor(image_processor=image_processor, tokenizer=tok,
                                         patch_size=patch, spatial_merge_size=merge)


@pytest.mark.parametrize("variant", sorted(PIXTRAL_VARIANTS))
def test_pixtral_size_only_matches_processor(variant):
    options, size, *_ = PIXTRAL_VARIANTS[variant]
    longest = size["longest_edge"]
    processor = pixtral_processor(variant)
    pairs, too_thin = [], 0
    for w, h in random_sizes(37, SIZE_ONLY_SAMPLES, top=6000):
        if h in (1, 3):
            # transformers' size-only path builds np.zeros((h, w, 3)) and reads an image 1 or
            # 3 pixels high as channels-first; the full pipeline below covers those heights.
            continue
        theirs = processor._get_num_multimodal_tokens(image_sizes=[(h, w)])["num_image_tokens"][0]
        try:
            ours = count_image_tokens("pixtral", w, h, **options)
        except ValueError:
            # Shrinks to zero pixels on one side: the size-only count still counts the row
            # breaks, the full pipeline fails ("height and width must be > 0"; tested below).
            too_thin += 1
            assert min(w, h) * longest < max(w, h)  # i.e. floor(short / ratio) == 0
            continue
        pairs.append(((w, h), ours, theirs))
    assert len(pairs) > 2500 and too_thin > 0
    assert mismatches(pairs) == []


@pytest.mark.parametrize("variant", sorted(PIXTRAL_VARIANTS))
def test_pixtral_full_pipeline_matches_count(variant):
    options = PIXTRAL_VARIANTS[variant][0]
    processor = pixtral_processor(variant)
    image = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    pairs = []
    for w, h in full_sizes(41, 9) + [(10000, 3), (3, 10000), (2049, 1)]:
        try:
            ours = count_image_tokens("pixtral", w, h, **options)
        except ValueError:
            with pytest.raises(ValueError):
                run_full(processor, "[IMG]", image, w, h)
            continue
        pairs.append(((w, h), ours, run_full(processor, "[IMG]", image, w, h)))
    assert mismatches(pairs) == []


# --------------------------------------------------------------------------- Idefics3


IDEFICS3_ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
IDEFICS3_IMAGE = ["<fake_token_around_image>", "<image>", "<global-img>", "\n", "\n\n", *IDEFICS3_ROW_COL]

IDEFICS3_VARIANTS = {
    # HuggingFaceM4/Idefics3-8B-Llama3
    "Idefics3-8B-Llama3": ({}, 1456, 364, 169, True),
    # HuggingFaceTB/SmolVLM-Instruct
    "SmolVLM-Instruct": (
        {"size": {"longest_edge": 1536}, "max_image_size": {"longest_edge": 384}, "image_seq_len": 81},
        1536, 384, 81, True,
    ),
    "no splitting": ({"do_image_splitting": False}, 1456, 364, 169, False),
    # A longest edge that is not a multiple of the tile: where the size-only shortcut fails.
    "longest 1000": ({"size": 1000}, 1000, 364, 169, True),
}


@functools.cache
def idefics3_processor(variant):
    _, longest, tile, seq, split = IDEFICS3_VARIANTS[variant]
    tok = tiny_tokenizer(
        ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *IDEFICS3_ROW_COL],
        plain=["\n\n", "\n"],
    )
    image_processor = transformers.Idefics3ImageProcessor(
        size={"longest_edge": longest}, max_image_size={"longest_edge": tile},
        do_image_splitting=split,
    )
    return transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tok,
                                          image_seq_len=seq)


class _ShapeOnly:
    """Runs Idefics3ImageProcessor's own resize/split logic on pixel-free arrays."""

    def __init__(self, image_processor):
        from transformers.models.idefics3 import image_processing_idefics3 as module

        self.module = module
        self.ip = image_processor

    def resize(self, image, size, **_):
        if "longest_edge" in size:
            h, w = self.module.get_resize_output_image_size(
                image, resolution_max_side=size["longest_edge"], input_data_format="channels_last"
            )
        else:
            h, w = size["height"], size["width"]
        return np.broadcast_to(np.zeros(1, np.uint8), (h, w, 3))

    def grid(self, width, height):
        ip = self.ip
        image = np.broadcast_to(np.zeros(1, np.uint8), (height, width, 3))
        original = ip.resize
        ip.resize = self.resize  # instance attribute: only this processor, only here
        try:
            image = ip.resize(image, size=ip.size)
            if not ip.do_image_splitting:
                return 0, 0
            image = ip.resize_for_vision_encoder(
                image, ip.max_image_size["longest_edge"], input_data_format="channels_last"
            )
            _, rows, cols = ip.split_image(
                image, max_image_size=ip.max_image_size, input_data_format="channels_last"
            )
            return rows, cols
        finally:
            ip.resize = original


def idefics3_tokens_from_grid(rows, cols, seq):
    # processing_idefics3.get_image_prompt_string, counted as the processor counts it.
    return seq + 3 if rows == 0 else seq + 3 + rows * ((seq + 2) * cols + 1)


@pytest.mark.parametrize("variant", sorted(IDEFICS3_VARIANTS))
def test_idefics3_matches_the_image_processors_own_resize_and_split(variant):
    options, *_, seq, _ = IDEFICS3_VARIANTS[variant]
    shapes = _ShapeOnly(idefics3_processor(variant).image_processor)
    pairs = []
    for w, h in random_sizes(43, SIZE_ONLY_SAMPLES // 2, top=10000):
        rows, cols = shapes.grid(w, h)
        pairs.append(((w, h), count_image_tokens("idefics3", w, h, **options),
                      idefics3_tokens_from_grid(rows, cols, seq)))
    assert mismatches(pairs) == []


@pytest.mark.parametrize("variant", ["Idefics3-8B-Llama3", "SmolVLM-Instruct", "longest 1000"])
def test_idefics3_size_only_shortcut_is_exact_only_when_the_edge_is_a_multiple_of_the_tile(variant):
    # transformers' _get_num_multimodal_tokens -> get_number_of_image_patches rounds the short
    # side up to whole tiles directly; the real resize_for_vision_encoder first rescales it
    # by the long side's rounding (with int() truncation). With the shipped configs the long
    # edge is a multiple of the tile and the two agree; otherwise they do not, and the full
    # pipeline sides with the real path, which is what count_image_tokens follows.
    options, longest, tile, seq, _ = IDEFICS3_VARIANTS[variant]
    processor = idefics3_processor(variant)
    shapes = _ShapeOnly(processor.image_processor)
    sizes = random_sizes(47, SIZE_ONLY_SAMPLES // 2, top=10000)
    theirs = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])
    differ = []
    for (w, h), t in zip(sizes, theirs["num_image_tokens"], strict=True):
        ours = count_image_tokens("idefics3", w, h, **options)
        assert ours == idefics3_tokens_from_grid(*shapes.grid(w, h), seq)
        if t != ours:
            differ.append((w, h))
    if longest % tile == 0:
        assert differ == []
    else:
        assert len(differ) > 20
        for w, h in sorted(differ, key=lambda size: size[0] * size[1])[:3]:
            full = run_full(processor, "<image>", IDEFICS3_IMAGE, w, h)
            assert full == count_image_tokens("idefics3", w, h, **options), (w, h)


def test_idefics3_shortcut_counts_an_unsplit_image_as_a_grid():
    # With do_image_splitting False the shortcut still reports a 1x1 grid (seq + 3 + seq + 3);
    # the processor writes the single-image prompt (seq + 3).
    processor = idefics3_processor("no splitting")
    assert processor._get_num_multimodal_tokens(image_sizes=[(100, 100)])["num_image_tokens"] == [344]
    assert count_image_tokens("idefics3", 100, 100, do_image_splitting=False) == 172
    assert run_full(processor, "<image>", IDEFICS3_IMAGE, 100, 100) == 172


@pytest.mark.parametrize("variant", sorted(IDEFICS3_VARIANTS))
def test_idefics3_full_pipeline_matches_count(variant):
    options = IDEFICS3_VARIANTS[variant][0]
    processor = idefics3_processor(variant)
    pairs = [
        ((w, h), count_image_tokens("idefics3", w, h, **options),
         run_full(processor, "<image>", IDEFICS3_IMAGE, w, h))
        for w, h in (full_sizes(53, 4) if variant in ("Idefics3-8B-Llama3", "SmolVLM-Instruct")
                     else EXTREMES[::3])
    ]
    assert mismatches(pairs) == []


# --------------------------------------------------------------------------- Phi-3-vision


def _phi3_reference_size(width: int, height: int, num_crops: int) -> tuple[int, int]:
    """An independent reading of the remote code's HD_transform + padding_336.

    Portrait images are turned landscape, resized to scale*336 wide where scale is the largest
    with scale * ceil(scale / ratio) <= num_crops, the height padded up to a multiple of 336
    (padding_336 splits the padding above and below), and turned back.
    """
    w, h = (height, width) if width < height else (width, height)
    ratio = w / h
    scale = 1
    while scale * np.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_w = int(scale * 336)
    new_h = int(new_w / ratio)
    top = int((np.ceil(new_h / 336) * 336 - new_h) / 2)
    bottom = int(np.ceil(new_h / 336) * 336) - new_h - top
    padded = (new_w, new_h + top + bottom)
    return padded[::-1] if width < height else padded


def _phi3_reference_tokens(width: int, height: int, num_crops: int) -> int:
    """Features as the model assembles them in Phi3HDImageEmbedding.hd_feature_transform.

    Every crop row is 12 feature rows of (12 * crops_wide + 1) features (a sub_GN newline
    closes each row), then one glb_GN separator, then the global view as 12 rows of 12 + 1.
    """
    padded_w, padded_h = _phi3_reference_size(width, height, num_crops)
    crops_high, crops_wide = padded_h // 336, padded_w // 336
    return crops_high * 12 * (crops_wide * 12 + 1) + 1 + 12 * (12 + 1)


def test_phi3_v_known_values():
    # 336x336, 4 crops: scale 2 (2*ceil(2/1) = 4 <= 4, 3*3 > 4) -> 672x672 -> 2x2 crops:
    # (4 + 1) * 144 + 1 + (2 + 1) * 12 = 757.
    assert count_image_tokens("phi3_v", 336, 336) == 757
    # 1920x1080, 4 crops: ratio 1.78, scale 2 (2*ceil(1.125) = 4; 3*ceil(1.69) = 6 > 4)
    # -> 672 wide, 378 high, padded to 672 -> 2x2 crops -> 757.
    assert count_image_tokens("phi3_v", 1920, 1080) == 757
    # Same image, 16 crops (Phi-3-vision-128k): scale 5 (5*ceil(2.81) = 15 <= 16,
    # 6*ceil(3.375) = 24 > 16) -> 1680x945, padded to 1680x1008 -> 3 rows x 5 columns:
    # (15 + 1) * 144 + 1 + (3 + 1) * 12 = 2353.
    assert count_image_tokens("phi3_v", 1920, 1080, num_crops=16) == 2353
    # A tall 500x2000 page, 4 crops: turned landscape (ratio 4): scale 4 (4*ceil(1) = 4)
    # -> 1344x336 -> turned back: 336 wide, 1344 high -> 4 rows x 1 column:
    # (4 + 1) * 144 + 1 + (4 + 1) * 12 = 781.
    assert count_image_tokens("phi3_v", 500, 2000) == 781
    assert phi3_v_hd_size(500, 2000, num_crops=4) == (336, 1344)


@pytest.mark.parametrize("num_crops", [4, 16, 1, 9])
def test_phi3_v_matches_an_independent_hd_transform(num_crops):
    # phi3_v is NOT compared with a running HF processor: microsoft/Phi-3.5-vision-instruct's
    # processor is remote code, not in transformers, and cannot be downloaded here. This
    # compares with the independent reimplementation above (HD transform arithmetic, feature
    # layout of the model) over seeded random sizes.
    pairs = []
    for w, h in random_sizes(59 + num_crops, SIZE_ONLY_SAMPLES // 2, top=10000):
        try:
            ours = count_image_tokens("phi3_v", w, h, num_crops=num_crops)
        except ValueError:  # so thin that the HD transform scales it to zero pixels
            assert int(336 * num_crops / (max(w, h) / min(w, h))) < 1
            continue
        pairs.append(((w, h), ours, _phi3_reference_tokens(w, h, num_crops)))
    assert len(pairs) > 1200
    assert mismatches(pairs) == []


def test_phi3_v_hd_transform_on_real_pixels_gives_the_padded_size():
    # The transform as the remote code performs it on a PIL image: transpose portrait images,
    # resize, paste on a white canvas padded to a multiple of 336, transpose back.
    for w, h in full_sizes(61, 9, top=1600):
        img = Image.new("RGB", (w, h))
        transposed = w < h
        if transposed:
            img = img.transpose(Image.Transpose.TRANSPOSE)
        ratio = img.width / img.height
        scale = 1
        while scale * np.ceil(scale / ratio) <= 4:
            scale += 1
        scale -= 1
        img = img.resize((int(scale * 336), int(int(scale * 336) / ratio)))
        canvas = Image.new("RGB", (img.width, int(np.ceil(img.height / 336) * 336)), "white")
        canvas.paste(img, (0, int((canvas.height - img.height) / 2)))
        if transposed:
            canvas = canvas.transpose(Image.Transpose.TRANSPOSE)
        assert phi3_v_hd_size(w, h, num_crops=4) == canvas.size, (w, h)
