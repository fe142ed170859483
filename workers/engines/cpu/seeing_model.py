"""A Qwen2.5-VL of the tiny model's shape, tokenizer and preprocessor, trained here on generated
images so that its answers depend on the pixels (docs/design/seeing-model.md). The trained
model is committed beside this file, in `seeing/`; vLLM serves it as it serves the tiny one.

Runs inside the engine environment (torch and transformers):

    <engine python> -m workers.engines.cpu.seeing_model recipe OUT_DIR
    <engine python> -m workers.engines.cpu.seeing_model train OUT_DIR [--seed 0] [--steps N]
        [--from MODEL_DIR] [--lr LR] [--presence-first F] [--text-aux W] [--mix TASKS]
    <engine python> -m workers.engines.cpu.seeing_model eval MODEL_DIR [--count N] [--json]
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image

from controlplane.imaging import synthetic
from workers.engines.cpu import tiny_model

ROOT = Path(__file__).resolve().parents[3]
MODEL_DIR = Path(__file__).resolve().parent / "seeing"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
               "TRAINING.json")

TASKS = ("read", "count", "presence")  # the first stage trains on them in equal parts
# What the committed model answers at least nine times in ten.
LEARNED = TASKS
STYLE = "plain"
SCALES = (1, 1 / 2, 1 / 4, 1 / 8)  # fractions of the pixels evaluated
TRAIN_CAPS = (1, 1, 1 / 2, 1 / 4)  # each training image is shrunk to one of these, drawn at random
HELD_OUT_SEED = 1_000_000_007  # training draws seeds below it
INITIALIZER_RANGE = 0.08  # at the default 0.02 the model stays at chance for hundreds of steps
AUX_WEIGHT = 1.0
# The committed model's recipe: `train` with each stage's arguments, in OUT_DIR; each later
# stage continues from the weights the one before saved there (docs/design/seeing-model.md).
RECIPE = (("--steps", "1500", "--threads", "2"),
          ("--from", "{out}", "--steps", "1200", "--threads", "1", "--lr", "1e-3",
           "--presence-first", "0.25", "--text-aux", "1", "--mix", "read,count,presence,presence"),
          ("--from", "{out}", "--steps", "300", "--threads", "1", "--lr", "5e-4",
           "--text-aux", "1", "--mix", "read,count,presence,presence"))

# What the vision side learns to tell apart in each merged token (the auxiliary loss).
CELL_CLASSES = (["none"] + list("0123456789abcdefghijklmnopqrstuvwxyz") + list(synthetic.SHAPES)
                + [f"{c} {s}" for c in synthetic.COLOURS for s in synthetic.SHAPES])


# What the text side learns to name at the position that answers a presence question (the
# second auxiliary loss).
OBJECTS = [f"{c} {s}" for c in synthetic.COLOURS for s in synthetic.SHAPES]


def _object_targets(samples):
    """Per presence question, the object asked about and the objects drawn (multi-hot)."""
    asked, drawn = [], []
    for sample in samples:
        if sample.task != "presence":
            continue
        asked.append(OBJECTS.index(sample.meta["object"]))
        drawn.append([float(any(item[0] == o for item in sample.meta["items"])) for o in OBJECTS])
    return asked, drawn


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def shrink(png: bytes, fraction: float):
    """The image with `fraction` of its pixels (each side scaled by its square root)."""

    image = Image.open(io.BytesIO(png)).convert("RGB")
    if fraction >= 1:
        return image
    side = math.sqrt(fraction)
    size = (max(1, round(image.width * side)), max(1, round(image.height * side)))
    return image.resize(size, Image.Resampling.BICUBIC)


def _cell_targets(samples, grids):
    """Per merged image token, the class of the drawn item whose centre lies in it."""
    targets = []
    for sample, (_, gh, gw) in zip(samples, grids.tolist(), strict=True):
        rows, cols = gh // 2, gw // 2
        cells = [0] * (rows * cols)
        sx, sy = gw * 14 / sample.width, gh * 14 / sample.height
        for label, x0, y0, x1, y1 in sample.meta["items"]:
            label = label.lower()
            if label not in CELL_CLASSES:
                continue
            row = min(rows - 1, int((y0 + y1) / 2 * sy / 28))
            col = min(cols - 1, int((x0 + x1) / 2 * sx / 28))
            cells[row * cols + col] = CELL_CLASSES.index(label)
        targets += cells
    return targets


def _batch(step_seed: int, size: int, caps=TRAIN_CAPS, tasks=TASKS):
    rng = random.Random(step_seed)
    samples = []
    for k in range(size):
        task = tasks[k % len(tasks)]
        samples += synthetic.generate(task, 1, seed=step_seed * 64 + k, style=STYLE)
    images = [shrink(s.image, rng.choice(caps)) for s in samples]
    return samples, images


def _inputs(processor, samples, images, answers: bool):
    prompts = [processor.apply_chat_template(messages(s.question), add_generation_prompt=True,
                                             tokenize=False) for s in samples]
    if answers:
        prompts = [p + s.answers[0] + "<|im_end|>" for p, s in zip(prompts, samples, strict=True)]
    return processor(text=prompts, images=images, padding=True, return_tensors="pt")


def stages(model_dir: Path) -> list[dict]:
    """The training stages recorded in a model's TRAINING.json, first first."""
    record = json.loads((Path(model_dir) / "TRAINING.json").read_text())
    return record.get("stages", [record])


def train(out: Path, *, seed: int, steps: int, threads: int, batch: int = 32, lr: float = 2e-3,
          presence_first: float = 0.0, text_aux: float = 0.0, mix=TASKS, start: Path | None = None,
          log=print) -> dict:
    """`presence_first`: the fraction of the steps, at the start, trained on presence alone;
    `text_aux`: the weight of the text side's auxiliary loss on presence questions; `mix`: the
    tasks of a batch after that, in turn; `start`: a trained model's directory whose saved
    (bf16) weights this run continues from, in fp32, on the batches after the ones it saw."""
    import torch  # the engine environment's
    from transformers import (  # the engine environment's
        AutoProcessor,
        Qwen2_5_VLForConditionalGeneration,
    )

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    seen = 0
    if start is not None:  # read before `out`, which may be the same directory, is written
        seen = sum(stage["steps"] for stage in stages(start))
        weights = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            start, dtype=torch.float32).state_dict()
    out.mkdir(parents=True, exist_ok=True)
    ids = tiny_model.build_tokenizer(out)
    tiny_model.write_processor_files(out, ids)
    model = Qwen2_5_VLForConditionalGeneration(tiny_model.model_config(ids, INITIALIZER_RANGE))
    if start is not None:
        model.load_state_dict(weights)
    processor = AutoProcessor.from_pretrained(out)
    processor.tokenizer.padding_side = "right"
    head = torch.nn.Linear(model.config.vision_config.out_hidden_size, len(CELL_CLASSES))
    captured = {}
    model.model.visual.register_forward_hook(
        lambda module, args, output: captured.__setitem__("cells", output.pooler_output))
    # Text side: at the position that answers, after the first layer, the object asked about
    # and the objects drawn.
    parameters = list(model.parameters()) + list(head.parameters())
    if text_aux:
        asked_head = torch.nn.Linear(model.config.text_config.hidden_size, len(OBJECTS))
        drawn_head = torch.nn.Linear(model.config.text_config.hidden_size, len(OBJECTS))
        parameters += list(asked_head.parameters()) + list(drawn_head.parameters())
    optimiser = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    answer_start = processor.tokenizer("<|im_start|>assistant\n")["input_ids"]
    im_start = ids["<|im_start|>"]
    model.train()
    started, losses, first = time.monotonic(), [], None
    for step in range(steps):
        tasks = ("presence",) if step < presence_first * steps else mix
        samples, images = _batch(seed * 1_000_003 + seen + step, batch, tasks=tasks)
        inputs = _inputs(processor, samples, images, answers=True)
        labels = inputs["input_ids"].clone()
        answering = []
        for row in range(labels.shape[0]):
            last = (inputs["input_ids"][row] == im_start).nonzero().max().item()
            labels[row, :last + len(answer_start)] = -100
            if samples[row].task == "presence":
                answering.append((row, last + len(answer_start) - 1))
        labels[inputs["attention_mask"] == 0] = -100
        output = model(**inputs, labels=labels, output_hidden_states=bool(text_aux))
        targets = torch.tensor(_cell_targets(samples, inputs["image_grid_thw"]))
        aux = torch.nn.functional.cross_entropy(head(captured["cells"]), targets)
        loss = output.loss + AUX_WEIGHT * aux
        objects = torch.zeros(())
        if text_aux and answering:
            rows, positions = zip(*answering, strict=True)
            state = output.hidden_states[1][list(rows), list(positions)]
            asked, drawn = _object_targets(samples)
            objects = (torch.nn.functional.cross_entropy(asked_head(state), torch.tensor(asked))
                       + torch.nn.functional.binary_cross_entropy_with_logits(
                           drawn_head(state), torch.tensor(drawn), reduction="sum") / len(drawn))
            loss = loss + text_aux * objects
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimiser.step()
        schedule.step()
        losses.append(output.loss.item())
        first = first if first is not None else losses[0]
        if step % 25 == 0 or step == steps - 1:
            log(f"step {step} answer loss {output.loss.item():.4f} cell loss {aux.item():.4f} "
                f"object loss {objects.item():.4f} "
                f"{time.monotonic() - started:.0f}s")
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tiny_model.write_processor_files(out, ids)  # over the generation defaults saved above
    tail = losses[-min(25, len(losses)):]
    options = {"from": str(start), "presence_first": presence_first, "text_aux": text_aux,
               "mix": list(mix)} if start is not None else {}
    return {"seed": seed, "steps": steps, "threads": threads, "batch": batch, "lr": lr, **options,
            "first_loss": round(first, 4), "final_loss": round(sum(tail) / len(tail), 4),
            "seconds": round(time.monotonic() - started)}


def held_out(count: int, tasks=TASKS) -> list:
    return [s for task in tasks for s in synthetic.generate(task, count, HELD_OUT_SEED, style=STYLE)]


def answer(model, processor, samples, images, batch: int = 16) -> list[str]:
    """Greedy answers under transformers, with Qwen-VL's 2-D image positions (M-RoPE)."""
    import torch  # the engine environment's

    processor.tokenizer.padding_side = "left"
    answers = []
    for start in range(0, len(samples), batch):
        part = slice(start, start + batch)
        inputs = _inputs(processor, samples[part], images[part], answers=False)
        assert "mm_token_type_ids" in inputs  # without it transformers falls back to 1-D positions
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        answers += processor.batch_decode(output[:, inputs["input_ids"].shape[1]:],
                                          skip_special_tokens=True)
    return [a.strip() for a in answers]


def correct(sample, reply: str) -> bool:
    return reply.strip().lower() in {a.lower() for a in sample.answers}


def loaded(model_dir: Path, *, threads: int):
    """A trained model and its processor, in fp32, ready to answer on `threads` threads."""
    import torch  # the engine environment's
    from transformers import (  # the engine environment's
        AutoProcessor,
        Qwen2_5_VLForConditionalGeneration,
    )

    torch.set_num_threads(threads)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def evaluate(model_dir: Path, *, count: int, threads: int, scales=SCALES, log=print) -> dict:
    """Exact match per task and per fraction of the pixels, and the answers at full size."""
    model, processor = loaded(model_dir, threads=threads)
    samples = held_out(count)
    result = {"count": count, "accuracy": {}, "answers": []}
    for scale in scales:
        replies = answer(model, processor, samples, [shrink(s.image, scale) for s in samples])
        if scale == 1:
            result["answers"] = replies
        for task in TASKS:
            marks = [correct(s, r) for s, r in zip(samples, replies, strict=True) if s.task == task]
            result["accuracy"].setdefault(task, {})[f"{scale:g}"] = round(sum(marks) / len(marks), 3)
        log(f"pixels x{scale:g}: " + ", ".join(
            f"{task} {result['accuracy'][task][f'{scale:g}']:.1%}" for task in TASKS))
    return result


def ensure(python: Path, path: Path | None = None) -> Path:
    """The trained model's directory: the committed one, or one trained with the engine
    environment's `python` by the recipe when it is missing (some 40 minutes on two cores)."""
    if path is None and all((MODEL_DIR / name).exists() for name in MODEL_FILES):
        return MODEL_DIR
    path = Path(path or Path(python).parent.parent / "models" / "seeing-qwen2_5_vl")
    if all((path / name).exists() for name in MODEL_FILES):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((path / name).exists() for name in MODEL_FILES):
            subprocess.run([str(python), "-m", "workers.engines.cpu.seeing_model", "recipe",
                            str(path)], cwd=ROOT, check=True, capture_output=True)
    return path


def recipe(out: Path, python: str = sys.executable) -> None:
    """Train the committed model's stages in turn, each in its own process, into `out`."""
    for stage in RECIPE:
        subprocess.run([python, "-m", "workers.engines.cpu.seeing_model", "train", str(out),
                        *(a.format(out=out) for a in stage)], cwd=ROOT, check=True)
    record = {"command": f"python -m workers.engines.cpu.seeing_model recipe {out}",
              "stages": stages(out)}
    (out / "TRAINING.json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="seeing_model", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    training = commands.add_parser("train", help="train a model into OUT_DIR")
    training.add_argument("out", type=Path)
    training.add_argument("--seed", type=int, default=0)
    training.add_argument("--steps", type=int, default=1000)
    training.add_argument("--threads", type=int, default=2,
                          help="one is faster on a busy machine (docs/design/seeing-model.md)")
    training.add_argument("--from", dest="start", type=Path,
                          help="continue from this trained model's weights (a second stage)")
    training.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    training.add_argument("--presence-first", type=float, default=0.0,
                          help="fraction of the steps, at the start, on presence alone")
    training.add_argument("--text-aux", type=float, default=0.0,
                          help="weight of the text side's auxiliary loss on presence questions")
    training.add_argument("--mix", default=",".join(TASKS),
                          help="tasks of a batch after presence alone, in turn, comma-separated")
    training.add_argument("--eval-count", type=int, default=100,
                          help="held-out questions per task measured after training (0: none)")
    recipe_parser = commands.add_parser(
        "recipe", help="train the committed model's stages in turn into OUT_DIR")
    recipe_parser.add_argument("out", type=Path)
    evaluation = commands.add_parser("eval", help="exact match per task and pixel fraction")
    evaluation.add_argument("model", type=Path)
    evaluation.add_argument("--count", type=int, default=100, help="questions per task")
    evaluation.add_argument("--threads", type=int, default=2)
    evaluation.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.command == "train":
        if args.steps < 1 or args.threads < 1 or args.lr <= 0:
            parser.error("--steps, --threads and --lr must be positive")
        if args.start is not None and not (args.start / "TRAINING.json").exists():
            parser.error("--from takes a directory the train command wrote")
        mix = tuple(args.mix.split(","))
        if not set(mix) <= set(TASKS):
            parser.error(f"--mix takes tasks among {', '.join(TASKS)}")
        if not 0 <= args.presence_first < 1 or args.text_aux < 0:
            parser.error("--presence-first must lie in [0, 1) and --text-aux be non-negative")
        record = {"command": "python -m workers.engines.cpu.seeing_model " + " ".join(argv),
                  **train(args.out, seed=args.seed, steps=args.steps, threads=args.threads,
                          lr=args.lr, presence_first=args.presence_first, text_aux=args.text_aux,
                          mix=mix, start=args.start, log=log)}
        if args.eval_count:
            found = evaluate(args.out, count=args.eval_count, threads=args.threads, log=log)
            record["held_out"] = {"count_per_task": args.eval_count, "style": STYLE,
                                  "exact_match_by_pixel_fraction": found["accuracy"]}
        earlier = stages(args.start) if args.start is not None else []
        written = {"stages": [*earlier, record]} if earlier else record
        (args.out / "TRAINING.json").write_text(json.dumps(written, indent=1) + "\n")
        print(json.dumps(record))
    elif args.command == "recipe":
        recipe(args.out)
    else:
        found = evaluate(args.model, count=args.count, threads=args.threads, log=log)
        print(json.dumps(found) if args.json else json.dumps(found["accuracy"], indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
