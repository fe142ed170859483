"""A cascade: a request sent first to a cheap tier, and to a strong one only when the cheap
answer is unsure (its token probability below the rule's threshold), cut short by max_tokens,
or a refusal; in the manner of FrugalGPT.

The first attempt is asked for its tokens' log-probabilities (the client sees them only if it
asked for them) and not streamed, as its answer is judged whole; it is admitted holding room
for the second attempt's worst case too, and settles to what it used before the second is
admitted. Each attempt is a request of its own in the usage, billed as what it was: the
second names the first (`cascade_of`), the first says why it was escalated and how sure it
was. A streamed request gets the first answer as a stream once it is kept, or the second's
stream. Should the second not be answered (its quota taken meanwhile, a limit of the second
tier's own, a failure), the first answer, which is whole, is sent, marked so.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from controlplane.gateway import state
from controlplane.gateway.admission import worst_ask
from controlplane.gateway.apps import current_process
from controlplane.gateway.http import Response, json_response
from controlplane.gateway.ledger import Ask
from controlplane.gateway.prepare import Prepared
from controlplane.gateway.rules import Facts, escalation, worst_image_tokens
from controlplane.gateway.tier_choice import Choice


@dataclass(frozen=True)
class Attempt:
    """What a request's usage record says of how it was routed, and what a cascade's first
    attempt holds for its second (`reserve_also`) and decides before it is recorded (`judge`)."""

    routed_by: str = ""
    cascade_of: str = ""
    reserve_also: Callable[[Prepared], Ask | None] | None = None
    judge: Callable[[object, dict], None] | None = None

    def mark(self, record):
        record.routed_by, record.cascade_of, record.judge = self.routed_by, self.cascade_of, self.judge
        return record


def cascades(choice: Choice, body: dict) -> bool:
    """Whether the request is served by its rule's cascade (a stream only if the rule says so)."""
    return choice.escalate_to is not None and (not body.get("stream") or choice.rule.cascade.streams)


def _copied(body: dict) -> dict:
    """The request as its client sent it, for one attempt to prepare (which rewrites its
    messages' content and its max_tokens) without touching the other's."""
    return {**body, "messages": [dict(message) for message in body["messages"]]}


Serve = Callable[..., Awaitable[Response]]  # (request id, tier, body, Attempt, started=...)


async def cascade(serve: Serve, request_id: str, key: state.KeyInfo, choice: Choice, body: dict,
                  facts: Facts) -> Response:
    rule, plan = choice.rule, choice.rule.cascade
    second_tier = choice.escalate_to
    client_stream, client_logprobs = bool(body.get("stream")), bool(body.get("logprobs"))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    first_body = {**_copied(body), "stream": False, "logprobs": True}
    first_body.pop("stream_options", None)
    second_body = _copied(body)
    judged: dict = {}

    def judge(record, answer: dict) -> None:
        record.escalation, record.confidence = escalation(answer, plan)
        judged.update(answer=answer, reason=record.escalation)

    def reserve_second(prepared: Prepared) -> Ask | None:
        # Its pictures as the second tier would count them: from their headers, or (given by
        # URL, not yet fetched) each as large as its policy allows.
        asked = min(facts.max_tokens or second_tier.max_output_tokens, second_tier.max_output_tokens)
        return worst_ask(key, second_tier, [worst_image_tokens(facts, second_tier)], prepared.text_tokens, asked)

    first = await serve(request_id, choice.tier, first_body,
                        Attempt(routed_by=rule.label, reserve_also=reserve_second, judge=judge))
    answer = judged.get("answer")
    if answer is None or first.status != 200:  # refused or failed before an answer: as it was
        return first
    reason = judged["reason"]
    sent = functools.partial(_sent, answer, first, client_stream=client_stream, client_logprobs=client_logprobs,
                             include_usage=include_usage)
    if not reason:
        current_process().counters.cascade(rule=rule.label, outcome="kept")
        return sent(note="kept")
    second_id = f"req_{uuid.uuid4().hex}"
    second = await serve(second_id, second_tier, second_body, Attempt(routed_by=rule.label, cascade_of=request_id),
                         started=time.monotonic())
    if second.status != 200:
        # Not admitted (its room taken between the two), refused by the second tier (a limit
        # of its own), or failed: the first answer, which is whole, marked so.
        current_process().counters.cascade(rule=rule.label, outcome="not_escalated")
        return sent(note=f"not escalated ({reason}): {_code(second)}")
    current_process().counters.cascade(rule=rule.label, outcome=reason)
    second.headers.update({"x-cascade": f"escalated: {reason}", "x-cascade-first-request-id": request_id})
    return second


def _code(response: Response) -> str:
    try:
        return orjson.loads(response.body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return str(response.status)


def _sent(answer: dict, first: Response, *, client_stream: bool, client_logprobs: bool, include_usage: bool,
          note: str) -> Response:
    """The first attempt's answer as its client asked for it."""
    if not client_logprobs:
        for choice in answer.get("choices") or ():
            if isinstance(choice, dict):
                choice["logprobs"] = None
    headers = {**first.headers, "x-cascade": note}
    if not client_stream:
        return json_response(answer, headers=headers)
    return Response(stream=_as_stream(answer, include_usage), content_type="text/event-stream",
                    headers={**headers, "cache-control": "no-cache"})


async def _as_stream(answer: dict, include_usage: bool):
    """A whole answer as the chunks a stream of it would have been."""
    base = {"id": answer.get("id"), "object": "chat.completion.chunk", "created": answer.get("created", int(time.time())),
            "model": answer.get("model")}
    for choice in answer.get("choices") or ():
        message = choice.get("message") or {}
        index = choice.get("index", 0)
        yield _event({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]})
        delta = {key: message[key] for key in ("content", "reasoning_content", "refusal") if message.get(key)}
        if message.get("tool_calls"):  # a stream's tool calls say which they are
            delta["tool_calls"] = [{"index": n, **call} for n, call in enumerate(message["tool_calls"])]
        if delta:
            yield _event({**base, "choices": [{"index": index, "delta": delta, "logprobs": choice.get("logprobs"),
                                               "finish_reason": None}]})
        yield _event({**base, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                           "finish_reason": choice.get("finish_reason")}]})
    if include_usage and answer.get("usage"):
        yield _event({**base, "choices": [], "usage": answer["usage"]})
    yield b"data: [DONE]\n\n"


def _event(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
