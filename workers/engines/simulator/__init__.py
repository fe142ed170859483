"""A vLLM-compatible engine for machines without a GPU.

It speaks vLLM's OpenAI API, health, version and Prometheus metrics, decodes the images
it receives and counts their tokens with the same family formulas as the gateway, and
takes time according to a cost model (prefill per token, image encoding per image token,
decode per token). It imports neither Django nor Celery.
"""
