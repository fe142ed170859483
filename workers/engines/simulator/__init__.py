"""A vLLM-compatible engine for machines without a GPU.

It speaks vLLM's OpenAI API, health, version and Prometheus metrics, decodes the images
it receives and counts their tokens with the same family formulas as the gateway, and
schedules requests like vLLM v1 (continuous batching, chunked prefill, a KV cache in
blocks of --block-size tokens with recompute preemption, fcfs or priority order, encoder
and block-level prefix caches), taking time per engine step according to a cost model (scheduler.py). Faults can
be injected for tests and drills: POST /sim/fault or --sim-fault. It imports neither
Django nor Celery.
"""
