"""`python -m workers.engines.simulator MODEL [vllm serve flags] --family FAMILY`."""

from __future__ import annotations

import argparse
import json
import os

import uvicorn

from workers.engines.simulator.engine import CostModel, SimulatedEngine
from workers.engines.simulator.server import App


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="simulator", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--family", required=True, help="Hugging Face model_type")
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--limit-mm-per-prompt", type=json.loads)
    parser.add_argument("--mm-processor-kwargs", type=json.loads, default={})
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    # Accepted for command-line parity with `vllm serve`; they shape GPU memory, not behaviour here.
    for flag in ("--tensor-parallel-size", "--gpu-memory-utilization", "--mm-processor-cache-gb",
                 "--kv-cache-dtype", "--scheduling-policy", "--dtype"):
        parser.add_argument(flag)
    parser.add_argument("--allowed-media-domains", nargs="*")
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true")
    parser.add_argument("--sim-prefill-us-per-token", type=float, default=CostModel.prefill_us_per_token)
    parser.add_argument("--sim-encode-us-per-image-token", type=float,
                        default=CostModel.encode_us_per_image_token)
    parser.add_argument("--sim-decode-ms-per-token", type=float, default=CostModel.decode_ms_per_token)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    limit = args.limit_mm_per_prompt
    images = None if not limit else int(limit["image"]["count"] if isinstance(limit["image"], dict)
                                         else limit["image"])
    engine = SimulatedEngine(
        served_model_name=args.served_model_name or args.model,
        family=args.family,
        mm_processor_kwargs=args.mm_processor_kwargs or {},
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        images_per_prompt=images,
        cost=CostModel(args.sim_prefill_us_per_token, args.sim_encode_us_per_image_token,
                       args.sim_decode_ms_per_token),
    )
    uvicorn.run(App(engine, api_key=args.api_key), host=args.host, port=args.port,
                log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
