"""Cheap-only, strong-only and a confidence cascade, through the gateway's routing rules, on the
real vLLM CPU engine serving the model the project trains to read (docs/design/seeing-model.md),
whose accuracy depends on the pixels it sees: accuracy and billed cost per 1,000 requests of
each, in one run, on a mixed set of easy and hard items.

    python -m bench.cascade [--items 40] [--json PATH]

The cheap attempt is the model at a low pixel cap (a rule sending to the tier at 12,544 px, a
quarter of its canvas: 18 image tokens); the strong one at its full canvas (50,176 px, 66
tokens), tiling a long picture past 4:1 as the tier's policy does. Easy items: held-out
questions of three tasks (reading, counting, presence: controlplane/imaging/synthetic.py) on
pictures of the canvas, which the model answers about as well at a quarter of the pixels. Hard
items: held-out banners, 1:6 to 1:15 (workers/engines/cpu/seeing_long.py), read only when
tiled at the full canvas (docs/quality.md). Prices are the bench world's: 1.00 a million
tokens of each kind, so cost is tokens; costs are what the metering billed, every attempt of
a cascade.

1. Calibration: the cheap and the strong rule answer a calibration set (another seed); the
   cheap one asked for logprobs, so each answer's mean token probability is known. From
   those, the cascade's trade-off curve (controlplane/benchmarks/cascade_curve.py), and the
   threshold: the cheapest within 1 point of the strong tier's accuracy.
2. Evaluation, on held-out items: cheap-only, strong-only, and the cascade at that threshold
   (a rule with the cheap tier escalating to the strong), each through the gateway as a
   client sends them; the curve predicted from the first two is printed beside the cascade's
   measured point. Target: the cascade within 2 points of the strong at no more than 70 % of
   its cost. Also the cascade behind a rule that sends large pictures (the banners) to the
   strong tier at once, as an operator who knows them would route.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import httpx

from bench.engine_path import EngineGateway, clean_up, engine_start, engine_stop, engine_wait
from bench.gateway import free_port
from bench.quality import TASKS, items

CHEAP_CAP, STRONG_CAP = 12_544, 224 * 224
CALIBRATION_SEED, EVALUATION_SEED = 1_000_000_009, 1_000_000_007  # both held out from training
MAX_TOKENS = 8
LARGE = 100_000  # pixels: the banners are 300,000 and more, the other pictures 50,176


@dataclass
class Answer:
    score: float
    cost: Decimal
    confidence: float | None = None
    cut_short: bool = False
    escalated: bool = False


def banners(count: int, seed: int) -> list:
    """Held-out banners, 1:6 to 1:15 (workers/engines/cpu/seeing_long.py): read only when tiled
    at the full canvas, past 4:1 (docs/quality.md)."""
    from controlplane.benchmarks.resolution import Item
    from controlplane.imaging import synthetic
    from workers.engines.cpu import seeing_model

    drawn = synthetic.generate("long", count, seed, style=seeing_model.STYLE, strip="banner", height=224,
                               ratio=(6, 15))
    return [Item(key=f"banner-{n}", data=s.image, width=s.width, height=s.height, content_type="image/png",
                 question=s.question, task_type="read", answers=s.answers) for n, s in enumerate(drawn)]


def _key(name: str, *rules: dict) -> str:
    """A key of the bench tenant whose requests for `auto` follow `rules` (in order): each a
    RoutingRule's fields, its tier the bench's one vision tier (`cascade`: escalating to it)."""
    from controlplane.catalog.models import ModelTier
    from controlplane.tenants.models import RoutingRule, Tenant
    from controlplane.tenants.services import api_key_create

    created = api_key_create(tenant=Tenant.objects.get(name="bench"), name=name)
    tier = ModelTier.objects.get(name="vlm")
    for position, fields in enumerate(rules, 1):
        fields = dict(fields)
        cascade = fields.pop("cascade", False)
        rule = RoutingRule(api_key=created.api_key, tier=tier, position=position, escalate_to=tier if cascade else None,
                           **fields)
        rule.full_clean()
        rule.save()
    return created.secret


def _billed(ids: list[str]) -> dict[str, Decimal]:
    """What the metering billed each request, once the gateway's usage is stored."""
    from controlplane.metering.models import UsageEvent
    from controlplane.metering.outbox import usage_ingest

    while usage_ingest():
        pass
    return dict(UsageEvent.objects.filter(request_id__in=ids).values_list("request_id", "cost"))


async def _ask_all(url: str, secret: str, questions: list, *, logprobs: bool) -> list[dict]:
    from controlplane.benchmarks.workload import data_url

    async with httpx.AsyncClient(timeout=120) as client:
        limit = asyncio.Semaphore(2)

        async def ask(item) -> dict:
            content = [{"type": "image_url", "image_url": {"url": data_url(item.data, item.content_type)}},
                       {"type": "text", "text": item.question}]
            body = {"model": "auto", "max_tokens": MAX_TOKENS, "temperature": 0,
                    "messages": [{"role": "user", "content": content}], **({"logprobs": True} if logprobs else {})}
            async with limit:
                response = await client.post(url, json=body, headers={"authorization": f"Bearer {secret}"})
            data = response.json()
            return {"status": response.status_code, "data": data, "headers": dict(response.headers)}

        return await asyncio.gather(*(ask(item) for item in questions))


def run_rule(url: str, secret: str, questions: list, *, logprobs: bool = False) -> list[Answer]:
    from controlplane.benchmarks import scoring
    from controlplane.gateway.rules import confidence

    replies = asyncio.run(_ask_all(url, secret, questions, logprobs=logprobs))
    ids = []
    for reply in replies:
        if reply["status"] != 200:
            raise SystemExit(f"the gateway answered {reply['status']}: {reply['data']}")
        ids.append(reply["headers"]["x-request-id"])
        if first := reply["headers"].get("x-cascade-first-request-id"):
            ids.append(first)
    billed = _billed(ids)
    answers = []
    for item, reply in zip(questions, replies, strict=True):
        choice = reply["data"]["choices"][0]
        text = choice["message"].get("content") or ""
        cost = billed[reply["headers"]["x-request-id"]]
        first = reply["headers"].get("x-cascade-first-request-id")
        if first:
            cost += billed[first]
        answers.append(Answer(score=scoring.score(text, item.answers, item.task_type)["score"], cost=cost,
                              confidence=confidence(choice, "mean") if logprobs else None,
                              cut_short=choice.get("finish_reason") == "length", escalated=bool(first)))
    return answers


def _summary(answers: list[Answer]) -> dict:
    from controlplane import intervals

    scores = [a.score for a in answers]
    interval = intervals.mean_interval(scores)
    return {"accuracy": sum(scores) / len(scores), "interval": interval,
            "cost_per_1000": sum((a.cost for a in answers), Decimal(0)) * 1000 / len(answers),
            "escalated": sum(a.escalated for a in answers) / len(answers)}


def _curve_items(cheap: list[Answer], strong: list[Answer]) -> list:
    from controlplane.benchmarks.cascade_curve import Item

    return [Item(confidence=c.confidence, cheap_score=c.score, cheap_cost=c.cost, strong_score=s.score,
                 strong_cost=s.cost, cut_short=c.cut_short) for c, s in zip(cheap, strong, strict=True)]


def _line(name: str, figures: dict, strong: dict | None = None) -> str:
    low, high = figures["interval"] or (0, 0)
    share = f" {100 * figures['cost_per_1000'] / strong['cost_per_1000']:5.1f} %" if strong else ""
    return (f"{name:24} {100 * figures['accuracy']:6.1f} % ({100 * low:.0f}–{100 * high:.0f})"
            f" {figures['cost_per_1000']:10.4f}{share} {100 * figures['escalated']:9.1f} %")


def run(per_task: int, json_path: Path | None, cheap_cap: int = CHEAP_CAP, strong_cap: int = STRONG_CAP,
        hard: int = 20) -> dict:
    from controlplane.benchmarks import cascade_curve
    from workers.engines.cpu import install, seeing_model

    python = install.ensure()
    model = seeing_model.ensure(python)
    engine_port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="bench-cascade-"))
    gateway = EngineGateway(engine_port, model, python)
    try:
        gateway.start()  # Django is set up from here on
        engine = engine_start(engine_port, folder)
        engine_wait(engine, engine_port)
        url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
        cheap_key = _key("cheap", {"pixel_cap": cheap_cap})
        strong_key = _key("strong", {"pixel_cap": strong_cap})
        tasks = list(TASKS)
        calibration = items(tasks, per_task, CALIBRATION_SEED) + banners(hard, CALIBRATION_SEED)
        evaluation = items(tasks, per_task, EVALUATION_SEED) + banners(hard, EVALUATION_SEED)
        print(f"{len(calibration)} calibration and {len(evaluation)} evaluation questions: {per_task} a task "
              f"({', '.join(tasks)}) and {hard} banners; cheap at {cheap_cap:,} px, strong at {strong_cap:,} px",
              flush=True)

        # 1. Calibration: the threshold from the curve.
        cheap = run_rule(url, cheap_key, calibration, logprobs=True)
        strong = run_rule(url, strong_key, calibration)
        strong_accuracy = _summary(strong)["accuracy"]
        calibrated = cascade_curve.curve(_curve_items(cheap, strong))
        chosen = cascade_curve.cheapest_within(calibrated, strong_accuracy - 0.01)
        threshold = max(0.01, min(0.99, chosen.threshold if chosen else 0.5))
        print(f"calibration: strong {100 * strong_accuracy:.1f} %; the cheapest threshold within 1 point of it: "
              f"{threshold:.4f}", flush=True)

        # 2. Evaluation: the three, and the curve predicted from cheap and strong.
        cascade = {"pixel_cap": cheap_cap, "cascade": True, "escalate_pixel_cap": strong_cap, "threshold": threshold}
        cascade_key = _key("cascade", cascade)
        # What an operator who knows large pictures need the strong tier would add: a rule
        # before the cascade sending pictures past LARGE pixels (the banners) there at once.
        sized_key = _key("sized, then cascade", {"min_source_pixels": LARGE, "pixel_cap": strong_cap}, cascade)
        cheap_eval = run_rule(url, cheap_key, evaluation, logprobs=True)
        strong_eval = run_rule(url, strong_key, evaluation)
        cascaded = run_rule(url, cascade_key, evaluation)
        sized = run_rule(url, sized_key, evaluation)
        figures = {"cheap only": _summary(cheap_eval), "strong only": _summary(strong_eval),
                   f"cascade at {threshold:.3f}": _summary(cascaded),
                   "sized rule, then cascade": _summary(sized)}
        strong_figures = figures["strong only"]
        print(f"\n{'':24} {'accuracy':>18} {'cost/1k req':>10} {'of strong':>7} {'escalated':>10}")
        for name, row in figures.items():
            print(_line(name, row, strong_figures), flush=True)
        cascade_figures = figures[f"cascade at {threshold:.3f}"]
        gap = 100 * (strong_figures["accuracy"] - cascade_figures["accuracy"])
        share = 100 * cascade_figures["cost_per_1000"] / strong_figures["cost_per_1000"]
        print(f"\nthe cascade: {gap:.1f} points below the strong tier at {share:.1f} % of its cost "
              f"(target: within 2 points at no more than 70 %): {'met' if gap <= 2 and share <= 70 else 'missed'}")
        sized_figures = figures["sized rule, then cascade"]
        sized_gap = 100 * (strong_figures["accuracy"] - sized_figures["accuracy"])
        sized_share = 100 * sized_figures["cost_per_1000"] / strong_figures["cost_per_1000"]
        print(f"a rule for large pictures, then the cascade: {sized_gap:.1f} points below at {sized_share:.1f} % "
              f"of its cost: {'met' if sized_gap <= 2 and sized_share <= 70 else 'missed'}")
        predicted = cascade_curve.curve(_curve_items(cheap_eval, strong_eval),
                                        [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, threshold, 1.0])
        print("\nthe threshold's trade-off on the evaluation set, predicted from cheap and strong:")
        print(f"{'threshold':>9} {'accuracy':>8} {'cost/1k':>8} {'escalated':>9}")
        for p in sorted(predicted, key=lambda p: p.threshold):
            print(f"{p.threshold:9.3f} {100 * p.accuracy:7.1f}% {p.cost_per_1000:8.4f} {100 * p.escalated:8.1f}%")
        result = {"per_task": per_task, "tasks": tasks, "threshold": threshold,
                  "figures": {name: {**row, "cost_per_1000": str(row["cost_per_1000"])} for name, row in figures.items()},
                  "gap_points": gap, "cost_share": share, "sized_gap_points": sized_gap,
                  "sized_cost_share": sized_share,
                  "curve": [{"threshold": p.threshold, "accuracy": p.accuracy, "cost_per_1000": str(p.cost_per_1000),
                             "escalated": p.escalated} for p in predicted]}
        if json_path is not None:
            json_path.write_text(json.dumps(result, indent=1, default=str))
        return result
    finally:
        clean_up(engine_stop, gateway.stop)
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=40, help="questions per task in each set (default 40)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--hard", type=int, default=20, help="banners in each set (default 20)")
    parser.add_argument("--cheap-cap", type=int, default=CHEAP_CAP, help=f"pixels (default {CHEAP_CAP:,})")
    parser.add_argument("--strong-cap", type=int, default=STRONG_CAP, help=f"pixels (default {STRONG_CAP:,})")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run's cleanup
    run(args.items, args.json, args.cheap_cap, args.strong_cap, args.hard)


if __name__ == "__main__":
    main()
