"""The quality–cost curve of the model the project trains, through the gateway, on the real
vLLM CPU engine: what each pixel cap costs and what it is worth.

    python -m bench.quality [--items 60] [--tasks read,count,presence] [--json PATH]

One vLLM CPU engine serves the trained Qwen2.5-VL (workers/engines/cpu/seeing_model.py),
launched as the fleet launches a tier; our gateway runs as bench/gateway runs it, its vision
tier on that engine. Each task's held-out questions (controlplane/imaging/synthetic.py, a
seed the model never trained on) are asked at every cap, the client scaling each picture as
an operator's pixel cap would, by the product's own resolution sweep; answers are scored by
each task's metric with a 95 % interval. Printed per cap: accuracy per task and over the set,
image tokens and cost per image, cost per correct answer, latency; then the policy advisor's
picks for a few targets, against the naive policy (every picture at full size), with the
saving per 1,000 images. Last, the same questions at full size sent to
the engine directly, answer for answer against the gateway's: the gateway must not change
what the model sees.

With --long, long strips (workers/engines/cpu/seeing_long.py's held-out receipts and banners, of
each ratio range in `--long-ratios`) under a pixel cap that binds (`--long-cap`), each made by
the gateway's own policy code as it would send them, asked of the engine directly: squashed
whole into the cap (tiling off), and tiled past each threshold of `--thresholds` (every tile
gets the full cap; the tier's engine takes as many images a prompt as its policy allows, four
by default, and refuses a prompt with more: a wrong answer); accuracy, image tokens and images
per strip for each, so that the tiling threshold is set from what it buys. `--model DIR`
serves another trained model than the committed one (one with the long stage, say).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
from decimal import Decimal
from pathlib import Path

from bench.engine_path import EngineGateway, clean_up, engine_start, engine_stop, engine_wait
from bench.gateway import free_port

FULL = 224 * 224  # the trained model's canvas
CAPS = (FULL, FULL // 2, FULL // 4, FULL // 8, FULL // 16)
TASKS = ("read", "count", "presence")
SEED = 1_000_000_007  # held out: the model trained on seeds below it
# What the advisor is asked, against the naive policy (every picture at full size).
TARGETS = (("within", 2.0), ("within", 10.0), ("at_least", 75.0))


def items(tasks: list[str], per_task: int, seed: int = SEED) -> list:
    from controlplane.benchmarks.resolution import Item
    from controlplane.imaging import synthetic
    from workers.engines.cpu import seeing_model

    found = []
    for task in tasks:
        for n, sample in enumerate(synthetic.generate(task, per_task, seed, style=seeing_model.STYLE)):
            found.append(Item(key=f"{task}-{n}", data=sample.image, width=sample.width, height=sample.height,
                              content_type="image/png", question=sample.question, task_type=task,
                              answers=sample.answers))
    return found


def sweep(url: str, key: str, model: str, caps: list[int], questions: list, max_tokens: int) -> list[tuple]:
    """(cap, samples, specs) per cap, asked through `url`."""
    from controlplane.benchmarks import loadgen, resolution
    from controlplane.benchmarks.services import token_estimator
    from controlplane.catalog.models import ModelTier

    tier = ModelTier.objects.select_related("resolution_policy").get(name=model)
    stages = resolution.sweep_specs(questions, caps, max_tokens=max_tokens, estimate_tokens=token_estimator(tier))
    target = loadgen.Target(url=url, model=model, api_key=key)
    samples, _ = asyncio.run(loadgen.run_fixed(target, stages, concurrency=2))
    return [(cap, stage_samples, {s.index: s for s in stage})
            for cap, stage_samples, stage in zip(caps, samples, stages, strict=True)]


def run(per_task: int, tasks: list[str], caps: list[int], json_path: Path | None, long_cap: int | None = None,
        thresholds: tuple[float, ...] = (20, 8, 4, 2), model: Path | None = None,
        long_ratios: tuple[tuple[float, float], ...] = ((6, 15),), long_strips: tuple[str, ...] = ("banner",)) -> dict:
    from controlplane.benchmarks import advisor, resolution
    from workers.engines.cpu import install, seeing_model

    python = install.ensure()
    model = model or seeing_model.ensure(python)
    engine_port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="bench-quality-"))
    gateway = EngineGateway(engine_port, model, python)
    try:
        key = gateway.start()  # Django is set up from here on
        from controlplane.benchmarks.services import _rates
        from controlplane.catalog.models import ModelTier

        engine = engine_start(engine_port, folder)
        engine_wait(engine, engine_port)
        tier = ModelTier.objects.get(name="vlm")
        rates = _rates(tier)
        questions = items(tasks, per_task)
        print(f"{len(questions)} held-out questions ({per_task} per task: {', '.join(tasks)}), caps {caps}",
              flush=True)
        through = sweep(f"http://127.0.0.1:{gateway.port}/v1/chat/completions", key, "vlm", caps, questions, 8)
        rows, points = [], []
        header = (f"{'cap px':>7} {'tokens':>6} " + " ".join(f"{t:>16}" for t in tasks)
                  + f" {'set':>16} {'$/1k img':>9} {'$/1k right':>10} {'p50 ms':>7}")
        print(header)
        for cap, samples, specs in through:
            summary = resolution.cap_summary(samples, specs, cap=cap, rates=rates)
            overall = resolution.set_figures(samples, specs)
            cost = Decimal(str(summary["cost_per_image"])) if summary["cost_per_image"] is not None else None
            right = overall["accuracy"] * len(samples) if overall["accuracy"] is not None else 0
            per_right = cost * len(samples) / Decimal(str(right)) if cost is not None and right else None
            cells = []
            for task in tasks:
                figures = summary["tasks"].get(task, {})
                low, high = figures.get("interval") or (None, None)
                cells.append(f"{_pct(figures.get('value'))} ({_pct(low, 0)}–{_pct(high, 0)})")
            low, high = overall["interval"] or (None, None)
            p50 = summary["e2e"]["p50"] if summary["e2e"] else None
            print(f"{cap:7d} {summary['mean_image_tokens'] or 0:6.0f} " + " ".join(f"{c:>16}" for c in cells)
                  + f" {_pct(overall['accuracy']) + f' ({_pct(low, 0)}–{_pct(high, 0)})':>16}"
                  + f" {_money(cost, 1000):>9} {_money(per_right, 1000):>10} {p50 or 0:7.0f}", flush=True)
            rows.append({"cap": cap, "tasks": summary["tasks"], "overall": overall,
                         "mean_image_tokens": summary["mean_image_tokens"],
                         "cost_per_image": str(cost) if cost is not None else None,
                         "cost_per_correct": str(per_right) if per_right is not None else None, "e2e": summary["e2e"],
                         "errors": summary["errors"]})
            points.append(advisor.Point(cap=cap, accuracy=overall["accuracy"] or 0.0, low=low or 0.0,
                                        high=high or 0.0, items=len(samples), cost_per_image=cost,
                                        image_tokens=summary["mean_image_tokens"]))
        print(f"\nthe advisor against the naive policy (every picture at full size, {max(caps):,} px), "
              f"at {rates.image_per_mtok if rates else '?'} per million image tokens:")
        advice = []
        for kind, value in TARGETS:
            found = advisor.advise(points, advisor.Target(kind, value), current_cap=max(caps))
            print(f"  {found.summary()}")
            advice.append({"target": str(found.target), "cap": found.chosen.cap if found.chosen else None,
                           "summary": found.summary(), "distinguishable_from_best": found.distinguishable_from_best,
                           "saving_per_1000": str(found.saving_per_1000) if found.saving_per_1000 is not None
                           else None})
        direct = sweep(f"http://127.0.0.1:{engine_port}/v1/chat/completions", "", "vlm", [max(caps)], questions, 8)
        by_index = {}
        for _, samples, specs in (through[0], direct[0]):
            for sample in samples:
                by_index.setdefault(specs[sample.index].meta["item"], []).append(sample.text.strip())
        same = sum(1 for answers in by_index.values() if len(answers) == 2 and answers[0] == answers[1])
        print(f"\nthe gateway against the engine directly, full size: {same} of {len(by_index)} answers the same")
        result = {"caps": rows, "tasks": tasks, "per_task": per_task, "seed": SEED,
                  "advice": advice,
                  "gateway_matches_direct": [same, len(by_index)]}
        if long_cap:
            result["long"] = long_images(f"http://127.0.0.1:{engine_port}/v1/chat/completions", per_task, long_cap,
                                         list(thresholds), list(long_ratios), list(long_strips))
        if json_path is not None:
            json_path.write_text(json.dumps(result, indent=1, default=str))
            print(f"written to {json_path}")
        return result
    finally:
        clean_up(engine_stop, gateway.stop)
        shutil.rmtree(folder, ignore_errors=True)


def long_images(engine_url: str, per_task: int, cap: int, thresholds: list[float],
                ratios: list[tuple[float, float]], strips: list[str]) -> list[dict]:
    """Strips under each tiling choice at `cap`, sent to the engine as the gateway would send them."""
    from controlplane.benchmarks import loadgen, resolution
    from controlplane.imaging.tokens import count_image_tokens
    from workers.engines.cpu import seeing_long

    rows = []
    choices = [None, *thresholds]
    print(f"\nlong strips ({per_task} a kind and ratio range) at a {cap:,}-pixel cap, sent to the engine as the "
          f"gateway would:\n{'strip':8} {'ratios':8} {'policy':18} {'accuracy':>18} {'images':>6} {'tokens':>7} "
          f"{'refused':>7}")
    for strip in strips:
        for low, high in ratios:
            # Over the cap, they are squashed (or tiled) as a long photo of a receipt or a screenshot would be.
            items = [resolution.Item(key=f"long-{n}", data=s.image, width=s.width, height=s.height,
                                     content_type="image/png", question=s.question, task_type="read",
                                     answers=s.answers)
                     for n, s in enumerate(seeing_long.held_out(strip, (low, high), per_task))]
            stages = resolution.variant_specs(
                items, [resolution.under_policy(seeing_long.policy(t, cap)) for t in choices], max_tokens=8,
                estimate_tokens=lambda w, h: count_image_tokens("qwen2_5_vl", w, h))
            samples, _ = asyncio.run(loadgen.run_fixed(loadgen.Target(url=engine_url, model="vlm"), stages,
                                                       concurrency=2))
            for threshold, stage, stage_samples in zip(choices, stages, samples, strict=True):
                specs = {spec.index: spec for spec in stage}
                figures = resolution.set_figures(stage_samples, specs)
                images = sum(spec.images for spec in stage) / len(stage)
                tokens = sum(spec.image_tokens for spec in stage) / len(stage)
                refused = sum(1 for sample in stage_samples if sample.error)
                low_ci, high_ci = figures["interval"] or (None, None)
                name = seeing_long.policy_name(threshold)
                print(f"{strip:8} {f'{low:g}-{high:g}':8} {name:18} "
                      f"{_pct(figures['accuracy']) + f' ({_pct(low_ci, 0)}–{_pct(high_ci, 0)})':>18} "
                      f"{images:6.1f} {tokens:7.0f} {refused:7d}", flush=True)
                rows.append({"strip": strip, "ratios": [low, high], "policy": name, "threshold": threshold,
                             "accuracy": figures["accuracy"], "interval": figures["interval"],
                             "images_per_strip": images, "image_tokens_per_strip": tokens, "refused": refused})
    return rows


def _pct(value, places: int = 1) -> str:
    return "—" if value is None else f"{100 * value:.{places}f}%"


def _money(value, per: int) -> str:
    return "—" if value is None else f"{value * per:.4f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=60, help="held-out questions per task (default 60)")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated (default {','.join(TASKS)})")
    parser.add_argument("--caps", help="comma-separated pixel caps (default: the full canvas down to 1/16)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--long", action="store_true", help="also measure tiling long strips")
    parser.add_argument("--long-cap", type=int, default=FULL, help=f"the pixel cap for --long (default {FULL})")
    parser.add_argument("--thresholds", default="20,8,4,2", help="tiling thresholds for --long (default 20,8,4,2)")
    parser.add_argument("--long-ratios", default="6-15", help="ratio ranges for --long (default 6-15)")
    parser.add_argument("--long-strips", default="banner", help="banner, receipt or both (default banner)")
    parser.add_argument("--model", type=Path, help="a trained model directory (default: the committed one)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run's cleanup
    caps = [int(c) for c in args.caps.split(",")] if args.caps else list(CAPS)
    run(args.items, args.tasks.split(","), sorted(caps, reverse=True), args.json,
        long_cap=args.long_cap if args.long else None, model=args.model,
        thresholds=tuple(float(t) for t in args.thresholds.split(",")),
        long_ratios=tuple(tuple(float(v) for v in r.split("-")) for r in args.long_ratios.split(",")),
        long_strips=tuple(args.long_strips.split(",")))


if __name__ == "__main__":
    main()
