"""`python -m workers.engines.simulator MODEL [vllm serve flags] --family FAMILY`."""

from __future__ import annotations

import argparse
import json
import os
import sys

import uvicorn

from workers.engines.simulator.engine import CostModel, EngineRequestError, SimulatedEngine
from workers.engines.simulator.scheduler import FAULT_MODES, POLICIES, Faults, SchedulerConfig
from workers.engines.simulator.server import CRASH_EXIT_CODE, App


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="simulator", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--family", required=True, help="Hugging Face model_type")
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=SchedulerConfig.max_num_batched_tokens)
    parser.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs")
    parser.add_argument("--limit-mm-per-prompt", type=json.loads)
    parser.add_argument("--mm-processor-kwargs", type=json.loads, default={})
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    # Accepted for command-line parity with `vllm serve`; they shape GPU memory, not behaviour here.
    for flag in ("--tensor-parallel-size", "--gpu-memory-utilization", "--mm-processor-cache-gb",
                 "--kv-cache-dtype", "--dtype"):
        parser.add_argument(flag)
    parser.add_argument("--allowed-media-domains", nargs="*")
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--block-size", type=int, default=SchedulerConfig.block_size,
                        help="tokens per KV block (vLLM: 16 on a GPU, 128 on its CPU build)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true")
    parser.add_argument("--enable-auto-tool-choice", action="store_true")
    parser.add_argument("--tool-call-parser")
    # The cost model and capacity (see scheduler.py for what a real GPU has).
    parser.add_argument("--sim-prefill-us-per-token", type=float, default=CostModel.prefill_us_per_token)
    parser.add_argument("--sim-encode-us-per-image-token", type=float,
                        default=CostModel.encode_us_per_image_token)
    parser.add_argument("--sim-decode-ms-per-token", type=float, default=CostModel.decode_ms_per_token,
                        help="what each running sequence adds to a decode step")
    parser.add_argument("--sim-step-overhead-ms", type=float, default=CostModel.step_overhead_ms,
                        help="the fixed cost of every engine step")
    parser.add_argument("--sim-kv-cache-tokens", type=int, default=SchedulerConfig.kv_cache_tokens,
                        help="KV cache capacity in tokens (in blocks of --block-size)")
    # A fault from the start; POST /sim/fault changes it at run time.
    parser.add_argument("--api", choices=("vllm", "sglang"), default="vllm",
                        help="whose endpoints and metric names to speak")
    parser.add_argument("--sim-fault", choices=FAULT_MODES, default="none")
    parser.add_argument("--sim-fault-factor", type=float, default=Faults.factor,
                        help="slow: every step takes this many times longer")
    parser.add_argument("--sim-fault-rate", type=float, default=Faults.rate,
                        help="error_rate: the fraction of chat requests answered 500")
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and not args.tool_call_parser:  # vLLM refuses to start too
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    return args


VLLM_MAX_IMAGE_PIXELS_DEFAULT = 178_956_970  # vllm/envs.py (0.32): Pillow's decompression-bomb bound


def _max_image_pixels(environ) -> int | None:
    """VLLM_MAX_IMAGE_PIXELS as vLLM reads it (0 or less: no limit; unset: vLLM's default)."""
    value = environ.get("VLLM_MAX_IMAGE_PIXELS", "")
    try:
        limit = int(value) if value else VLLM_MAX_IMAGE_PIXELS_DEFAULT
    except ValueError:
        sys.exit(f"simulator: VLLM_MAX_IMAGE_PIXELS must be an integer, not {value!r}")
    return limit if limit > 0 else None


def engine_from_args(args, environ) -> SimulatedEngine:
    limit = args.limit_mm_per_prompt
    images = None if not limit else int(limit["image"]["count"] if isinstance(limit["image"], dict)
                                         else limit["image"])
    return SimulatedEngine(
        served_model_name=args.served_model_name or args.model,
        family=args.family,
        mm_processor_kwargs=args.mm_processor_kwargs or {},
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        images_per_prompt=images,
        cost=CostModel(args.sim_prefill_us_per_token, args.sim_encode_us_per_image_token,
                       args.sim_decode_ms_per_token, args.sim_step_overhead_ms),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=args.sim_kv_cache_tokens,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        block_size=args.block_size,
        auto_tool_choice=args.enable_auto_tool_choice,
        max_image_pixels=_max_image_pixels(environ),
    )


def main(argv=None):
    args = parse_args(argv)
    if args.sim_fault == "crash":
        print("simulator: crashing at start (--sim-fault crash)", file=sys.stderr, flush=True)
        os._exit(CRASH_EXIT_CODE)
    engine = engine_from_args(args, os.environ)
    try:
        engine.set_fault(args.sim_fault, args.sim_fault_factor, args.sim_fault_rate)
    except EngineRequestError as exc:
        sys.exit(f"simulator: --sim-fault: {exc}")
    uvicorn.run(App(engine, api_key=args.api_key, api=args.api), host=args.host, port=args.port,
                log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
