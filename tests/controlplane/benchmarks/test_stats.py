"""The statistics, the SSE timing and the request mix: pure functions, fixed inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal

import pytest

from controlplane.benchmarks import stats
from controlplane.benchmarks.loadgen import DONE, Sample, StreamTiming, parse_sse_line
from controlplane.benchmarks.workload import Bucket, Mix, UploadedImage, Workload, synthetic_jpeg
from controlplane.metering.rating import Rates

SLO = stats.Slo(ttft_ms=200, tpot_ms=20)
RATES = Rates(text_input_per_mtok=Decimal("1"), image_per_mtok=Decimal("2"),
              output_per_mtok=Decimal("4"), per_image_fee=Decimal("0.001"))


def sample(klass="text", ttft=0.1, e2e=0.5, out=21, ok=True, images=0, image_tokens=0, prompt=100, **kw):
    return Sample(index=0, klass=klass, ok=ok, ttft=ttft, e2e=e2e, output_tokens=out, images=images,
                  image_tokens=image_tokens, prompt_tokens=prompt, error="" if ok else "HTTP 500: boom", **kw)


def test_percentiles_interpolate_between_ranks_like_numpy():
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert stats.percentile(values, 0.5) == 5.5
    assert stats.percentile(values, 0.9) == pytest.approx(9.1)
    assert stats.percentile(values, 0.99) == pytest.approx(9.91)
    assert stats.percentile([7], 0.99) == 7
    assert stats.percentile([], 0.5) is None
    assert stats.percentile(reversed(values), 0) == 1  # order of the input does not matter


def test_time_per_output_token_leaves_the_first_token_out():
    assert sample(ttft=0.1, e2e=0.5, out=21).tpot == pytest.approx(0.02)
    assert sample(out=1).tpot is None  # one token: nothing after the first


def test_goodput_counts_only_successes_within_both_slos():
    samples = [
        sample(ttft=0.1, e2e=0.3, out=11),   # 20 ms per token: meets both
        sample(ttft=0.3, e2e=0.4, out=11),   # first token too late
        sample(ttft=0.1, e2e=0.5, out=11),   # 40 ms per token: too slow after the first
        sample(ok=False),                     # failed
        sample(ttft=0.05, e2e=0.05, out=1),   # one token: judged on TTFT alone
    ]
    summary = stats.stage_summary(samples, duration_s=2.0, slo=SLO)
    assert summary["goodput"] == {"requests_per_s": 1.0, "share": 0.4}
    assert summary["requests"] == 5 and summary["errors"] == 1
    assert summary["error_examples"] == ["HTTP 500: boom"]
    assert summary["throughput"]["requests_per_s"] == 2.0  # four successes in two seconds


def test_a_stage_reports_percentiles_per_request_class_in_milliseconds():
    text = [sample(ttft=t / 1000) for t in range(1, 101)]  # 1..100 ms
    images = [sample("image", ttft=0.5, images=1, image_tokens=400, prompt=460) for _ in range(10)]
    summary = stats.stage_summary(text + images, duration_s=10, slo=SLO)
    assert set(summary["classes"]) == {"text", "image"}
    assert summary["classes"]["text"]["ttft"]["p50"] == pytest.approx(50.5)
    assert summary["classes"]["text"]["ttft"]["p99"] == pytest.approx(99.01)
    assert summary["classes"]["image"]["ttft"]["p90"] == 500
    assert summary["classes"]["image"]["mean_image_tokens"] == 400
    assert summary["throughput"]["image_tokens_per_s"] == 400  # 10 x 400 in 10 s
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(110 * 21 / 10)


def test_inter_token_latencies_are_pooled_over_requests():
    samples = [sample(itl=[0.01, 0.01]), sample(itl=[0.03])]
    assert stats.stage_summary(samples, duration_s=1, slo=SLO)["all"]["itl"]["p50"] == 10


def test_cost_per_image_prices_image_tokens_and_fees_at_the_tier_rates():
    samples = [sample("image", images=2, image_tokens=1000, prompt=1100, out=10),
               sample("large_image", images=1, image_tokens=3000, prompt=3050, out=10),
               sample("text", prompt=100, out=10)]
    cost = stats.stage_summary(samples, duration_s=1, slo=SLO, rates=RATES)["cost"]
    # 4000 image tokens at 2/M = 0.008, plus 3 images at 0.001: 0.011 for 3 images
    assert cost["per_image"] == "0.003667"
    # the text request: 100 input at 1/M + 10 output at 4/M
    assert cost["per_request"]["text"] == "0.000140"
    assert Decimal(cost["total"]) == Decimal("0.000140") + Decimal("0.004140") + Decimal("0.007090")


def test_sse_lines_parse_to_chunks_done_or_nothing():
    assert parse_sse_line('data: {"choices": []}') == {"choices": []}
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("data: {not json") is None


def chunk(content=None, usage=None):
    event = {"choices": [] if content is None else [{"delta": {"content": content}}]}
    if usage:
        event["usage"] = usage
    return event


def test_a_stream_is_timed_from_its_first_content_chunk_and_counted_from_its_usage():
    timing = StreamTiming(Sample(index=1, klass="image", image_tokens=99), sent_at=10.0)
    timing.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 10.10)  # role only
    timing.feed(chunk("Hello"), 10.25)
    timing.feed(chunk(" there"), 10.30)
    timing.feed(chunk(" friend"), 10.40)
    timing.feed(chunk(usage={"prompt_tokens": 500, "completion_tokens": 3,
                             "prompt_tokens_details": {"image_tokens": 420}}), 10.41)
    timing.feed(DONE, 10.42)
    result = timing.close(10.42)
    assert result.ok and result.error == ""
    assert result.ttft == pytest.approx(0.25)
    assert result.itl == pytest.approx([0.05, 0.10])
    assert result.e2e == pytest.approx(0.42)
    assert (result.prompt_tokens, result.output_tokens, result.image_tokens) == (500, 3, 420)
    assert result.tpot == pytest.approx(0.085)


def test_a_stream_without_usage_counts_its_chunks_and_keeps_the_estimated_image_tokens():
    timing = StreamTiming(Sample(index=1, klass="image", image_tokens=99), sent_at=0.0)
    for n in range(4):
        timing.feed(chunk("x"), 0.1 * (n + 1))
    timing.feed(DONE, 0.5)
    result = timing.close(0.5)
    assert result.ok and result.output_tokens == 4 and result.image_tokens == 99


def test_an_error_in_the_stream_or_a_cut_stream_fails_the_request():
    broken = StreamTiming(Sample(index=1, klass="text"), sent_at=0.0)
    broken.feed(chunk("x"), 0.1)
    broken.feed({"error": {"message": "the engine failed while streaming"}}, 0.2)
    broken.feed(DONE, 0.3)
    assert not broken.close(0.3).ok
    assert "engine failed" in broken.sample.error
    cut = StreamTiming(Sample(index=2, klass="text"), sent_at=0.0)
    cut.feed(chunk("x"), 0.1)
    result = cut.close(0.2)
    assert not result.ok and "before [DONE]" in result.error


def test_the_mix_is_deterministic_and_holds_its_shares():
    mix = Mix(text_share=0.7, buckets=(Bucket(640, 480, 3), Bucket(1920, 1080, 1)), images_min=1, images_max=2,
              prompt_tokens=(10, 20), output_tokens=(5, 5))
    workload = Workload(mix, seed=3, estimate_tokens=lambda w, h: w * h // 784, large_threshold=2000)
    specs = [workload.spec(n) for n in range(600)]
    again = Workload(mix, seed=3, estimate_tokens=lambda w, h: w * h // 784, large_threshold=2000)
    assert [s.body for s in specs[:20]] == [again.spec(n).body for n in range(20)]
    text = [s for s in specs if s.klass == "text"]
    assert 0.63 < len(text) / len(specs) < 0.77
    assert all(s.images == 0 and s.body["max_tokens"] == 5 for s in text)
    with_images = [s for s in specs if s.images]
    assert {s.images for s in with_images} == {1, 2}
    sizes = [size for s in with_images for size in s.sizes]
    assert 0.65 < sizes.count((640, 480)) / len(sizes) < 0.85  # weight 3 of 4
    # large: more estimated image tokens than the tier's threshold
    assert all((s.klass == "large_image") == (s.image_tokens > 2000) for s in with_images)
    assert {s.klass for s in with_images} == {"image", "large_image"}


def test_uploaded_images_replace_the_buckets():
    upload = UploadedImage(data=synthetic_jpeg(300, 200, 0), width=300, height=200)
    workload = Workload(Mix(text_share=0.0, uploads=(upload,)), seed=1)
    spec = workload.spec(0)
    assert spec.sizes == [(300, 200)]
    assert spec.body["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/jpeg;base64,")


def test_synthetic_images_vary_by_variant_so_caches_see_different_pictures():
    assert synthetic_jpeg(320, 240, 1) != synthetic_jpeg(320, 240, 2)
    assert synthetic_jpeg(320, 240, 1) == synthetic_jpeg(320, 240, 1)


def test_the_load_generator_statistics_and_scoring_import_neither_django_nor_celery():
    probe = ("import importlib, json, sys\n"
             "for m in ('controlplane.benchmarks.loadgen', 'controlplane.benchmarks.stats',"
             " 'controlplane.benchmarks.scoring', 'controlplane.benchmarks.resolution',"
             " 'controlplane.benchmarks.workload'): importlib.import_module(m)\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'celery'))))")
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == []
