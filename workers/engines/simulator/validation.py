"""Request options vLLM's OpenAI server refuses before it reads the prompt.

The messages are vLLM 0.32's own (vllm/entrypoints/openai/chat_completion/protocol.py and
vllm/renderers/online_renderer.py), so that a client, or the gateway relaying the
refusal, sees from the simulator what it would see from vLLM.
"""

from __future__ import annotations


class EngineRequestError(ValueError):
    """A request the engine answers with 400. `parameter` names the field at fault and ends
    the message, as vLLM's validation errors do."""

    def __init__(self, message: str, *, parameter: str | None = None):
        super().__init__(f"{message} (parameter={parameter})" if parameter else message)
        self.parameter = parameter


def check_options(body: dict, *, auto_tool_choice: bool) -> None:
    if body.get("stream_options") and not body.get("stream"):
        raise EngineRequestError("Stream options can only be defined when `stream=True`.",
                                 parameter="stream_options")
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int | float):
            raise EngineRequestError("`top_logprobs` must be an integer.", parameter="top_logprobs")
        if top < 0 and top != -1:
            raise EngineRequestError("`top_logprobs` must be a positive value or -1.",
                                     parameter="top_logprobs")
        if top != 0 and not body.get("logprobs"):
            raise EngineRequestError("when using `top_logprobs`, `logprobs` must be set to true.",
                                     parameter="top_logprobs")
    _check_tools(body, auto_tool_choice)


def _check_tools(body: dict, auto_tool_choice: bool) -> None:
    tools = body.get("tools")
    if tools == []:
        raise EngineRequestError("`tools` must not be an empty array. Either provide at least one "
                                 "tool or omit the field entirely.", parameter="tools")
    # vLLM defaults tool_choice to "auto" when tools are given.
    choice = body.get("tool_choice", "auto" if tools else None)
    if choice is None or choice == "none":
        return
    if tools is None:
        raise EngineRequestError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise EngineRequestError(f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                                 '"none", "auto" or "required" are supported.', parameter="tool_choice")
    # Tool calls need a parser, which vLLM loads only with --enable-auto-tool-choice and
    # --tool-call-parser both given (the simulator answers in plain text once they are).
    if auto_tool_choice:
        return
    if choice == "auto":
        raise EngineRequestError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    function = choice.get("function") if isinstance(choice, dict) else None
    described = f'function "{function.get("name")}"' if isinstance(function, dict) else f'"{choice}"'
    raise EngineRequestError(f"tool_choice={described} requires --tool-call-parser to be set")
