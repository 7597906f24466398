"""Generation requests and responses of the simulated server (pure: no IO, no clock).

What a client sends to SGLang 0.5.23's ``/generate`` and the OpenAI-compatible
``/v1/completions`` and ``/v1/chat/completions`` is parsed into a :class:`GenSpec`
(:func:`parse_generate`, :func:`parse_completion`, :func:`parse_chat`); bad input raises
:class:`GenRequestError` naming the field and the expected form, answered with the
status and body SGLang gives (:func:`generate_error_body`, :func:`openai_error_body`).
The bodies of the answers (whole, or one streamed chunk per emitted token or verify)
are built here too.

Token counts. The simulated model has no tokenizer: a prompt given as text counts
``ceil(characters / CHARS_PER_TOKEN)`` tokens (at least 1), OpenAI's rule of thumb of
about 4 characters per token of English text; a chat prompt counts its messages' text
that way plus :data:`CHAT_TOKENS_PER_MESSAGE` per message (the role and template
markers, the overhead OpenAI's counting recipe adds); ``input_ids`` count one token
each. The output is always as long as the request allows (``max_new_tokens`` /
``max_tokens`` / ``max_completion_tokens``, else the endpoint's SGLang default): the
simulated model never emits an end-of-sequence token, so ``ignore_eos`` changes nothing
and ``finish_reason`` is ``length``. The text is filler (:func:`filler_text`), and every
answer says so (``meta_info.specgov_sim`` on ``/generate``, ``system_fingerprint`` on
the OpenAI routes). Sampling parameters other than the output length are accepted and
have no effect on the simulation (the simulated acceptance does not depend on them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import check_bool, is_int

CHARS_PER_TOKEN: Final = 4
CHAT_TOKENS_PER_MESSAGE: Final = 4
# SGLang 0.5.23's defaults: SamplingParams.max_new_tokens (/generate) and
# CompletionRequest.max_tokens; a chat request without a limit runs to the context length
# there (the model stops at its EOS), and the simulated model has none, so it gets the
# /generate default.
GENERATE_DEFAULT_MAX_NEW_TOKENS: Final = 128
COMPLETION_DEFAULT_MAX_TOKENS: Final = 16
CHAT_DEFAULT_MAX_TOKENS: Final = 128
FILLER_NOTE: Final = "specgov-sim: simulated server, filler text"
_FILLER_WORDS: Final = ("sim", " filler", " text", " from", " a", " simulated", " model", ".")

Endpoint = Literal["generate", "completion", "chat"]


class GenRequestError(SpecgovError, ValueError):
    """A generation request the simulated server (like SGLang) refuses; ``status`` is
    the HTTP status, ``param`` the offending field (OpenAI's ``param``)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class GenSpec:
    """One parsed generation request."""

    endpoint: Endpoint
    prompt_tokens: int
    max_tokens: int
    stream: bool
    model: str | None = None  # the OpenAI ``model`` field (None on /generate)
    rid: str | None = None  # /generate's request id
    include_usage: bool = False  # OpenAI stream_options.include_usage
    prompt_text: str | None = None  # /v1/completions with echo


def count_text_tokens(text: str) -> int:
    """Prompt tokens of ``text`` by the stated rule (module docstring)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def filler_text(start: int, count: int) -> str:
    """The text of output tokens ``start .. start+count-1`` (one word per token)."""
    n = len(_FILLER_WORDS)
    return "".join(_FILLER_WORDS[i % n] for i in range(start, start + count))


def filler_ids(start: int, count: int) -> list[int]:
    """Token ids of output tokens ``start .. start+count-1`` (arbitrary, stable)."""
    n = len(_FILLER_WORDS)
    return [1000 + i % n for i in range(start, start + count)]


def _require_object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise GenRequestError(f"body: expected a JSON object, got {type(body).__name__}")
    return body


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    return check_bool(
        key, value, error=lambda message: GenRequestError(message, param=key), form="true or false"
    )


def _limit(value: object, key: str, *, default: int, minimum: int) -> int:
    if value is None:
        return default
    if not is_int(value):
        raise GenRequestError(f"{key}: expected an integer, got {value!r}", param=key)
    if value < minimum:
        raise GenRequestError(
            f"{key}: must be at least {minimum} on the simulated server, got {value}",
            param=key,
        )
    return value


def _token_ids(value: object, key: str) -> int:
    if not isinstance(value, list) or not value:
        raise GenRequestError(f"{key}: expected a non-empty list of token ids", param=key)
    for i, tok in enumerate(value):
        if not is_int(tok) or tok < 0:
            raise GenRequestError(
                f"{key}[{i}]: expected a non-negative integer token id, got {tok!r}", param=key
            )
    return len(value)


def _model(body: Mapping[str, Any], *, required: bool) -> str | None:
    model = body.get("model")
    if model is None and not required:
        return None
    if not isinstance(model, str) or not model:
        raise GenRequestError("model: expected the model name (a string)", param="model")
    return model


def parse_generate(raw: object) -> GenSpec:
    """An SGLang ``/generate`` body (``GenerateReqInput``, one request, not a batch)."""
    body = _require_object(raw)
    text, ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise GenRequestError("input_embeds: not supported by the simulated server")
    if (text is None) == (ids is None):
        raise GenRequestError("Either text, input_ids or input_embeds should be provided.")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise GenRequestError("batch requests (a list of prompts) are not simulated; send one")
    if text is not None:
        if not isinstance(text, str):
            raise GenRequestError(f"text: expected a string, got {type(text).__name__}")
        prompt = count_text_tokens(text)
    else:
        prompt = _token_ids(ids, "input_ids")
    sampling = body.get("sampling_params")
    if sampling is None:
        sampling = {}
    if not isinstance(sampling, Mapping):
        raise GenRequestError("sampling_params: expected a JSON object")
    _bool(sampling, "ignore_eos")
    max_new = _limit(
        sampling.get("max_new_tokens"),
        "sampling_params.max_new_tokens",
        default=GENERATE_DEFAULT_MAX_NEW_TOKENS,
        minimum=1,
    )
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise GenRequestError(f"rid: expected a string, got {rid!r}")
    return GenSpec("generate", prompt, max_new, _bool(body, "stream"), rid=rid)


def _stream_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise GenRequestError("stream_options: expected a JSON object", param="stream_options")
    return _bool(options, "include_usage")


def parse_completion(raw: object) -> GenSpec:
    """An OpenAI ``/v1/completions`` body (one prompt: a string or a list of token ids)."""
    body = _require_object(raw)
    model = _model(body, required=True)
    prompt = body.get("prompt")
    echo_text: str | None = None
    if isinstance(prompt, str):
        tokens = count_text_tokens(prompt)
        echo_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        tokens = _token_ids(prompt, "prompt")
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        tokens = count_text_tokens(prompt[0])
        echo_text = prompt[0]
    else:
        raise GenRequestError(
            "prompt: expected a string or a list of token ids (one prompt)", param="prompt"
        )
    if _limit(body.get("n"), "n", default=1, minimum=1) != 1:
        raise GenRequestError("n: only 1 is simulated", param="n")
    max_tokens = _limit(
        body.get("max_tokens"), "max_tokens", default=COMPLETION_DEFAULT_MAX_TOKENS, minimum=1
    )
    stream = _bool(body, "stream")
    echo = _bool(body, "echo")
    return GenSpec(
        "completion",
        tokens,
        max_tokens,
        stream,
        model=model,
        include_usage=stream and _stream_usage(body),
        prompt_text=echo_text if echo else None,
    )


def _message_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise GenRequestError(
                    f"{where}.content[{j}]: only text parts are simulated", param="messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise GenRequestError(
                    f"{where}.content[{j}].text: expected a string", param="messages"
                )
            parts.append(text)
        return "".join(parts)
    raise GenRequestError(f"{where}.content: expected a string or text parts", param="messages")


def parse_chat(raw: object) -> GenSpec:
    """An OpenAI ``/v1/chat/completions`` body."""
    body = _require_object(raw)
    model = _model(body, required=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GenRequestError("messages: expected a non-empty list of messages", param="messages")
    chars = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise GenRequestError(
                f"{where}: expected an object with a role and content", param="messages"
            )
        chars += len(_message_text(message.get("content"), where))
    prompt = max(1, math.ceil(chars / CHARS_PER_TOKEN)) + CHAT_TOKENS_PER_MESSAGE * len(messages)
    if _limit(body.get("n"), "n", default=1, minimum=1) != 1:
        raise GenRequestError("n: only 1 is simulated", param="n")
    limit_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    key = limit_key or "max_tokens"
    max_tokens = _limit(body.get(key), key, default=CHAT_DEFAULT_MAX_TOKENS, minimum=1)
    stream = _bool(body, "stream")
    return GenSpec(
        "chat",
        prompt,
        max_tokens,
        stream,
        model=model,
        include_usage=stream and _stream_usage(body),
    )


def check_fits(spec: GenSpec, context_tokens: int) -> None:
    """SGLang's total-token check (``validate_total_tokens``): prompt + output must fit
    the context; the simulated server's context is its KV pool."""
    total = spec.prompt_tokens + spec.max_tokens
    if total > context_tokens:
        raise GenRequestError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_tokens} tokens. You requested a total of {total} tokens: "
            f"{spec.prompt_tokens} tokens from the input messages and {spec.max_tokens} "
            f"tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit."
        )


# ------------------------------------------------------------------ error bodies


def generate_error_body(message: str) -> dict[str, Any]:
    """``/generate``'s error body (``_create_error_response``)."""
    return {"error": {"message": message}}


def openai_error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI routes' ``ErrorResponse`` (``serving_base.create_error_response``)."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError"}
    return {
        "object": "error",
        "message": message,
        "type": kind.get(status, "ServiceUnavailableError" if status == 503 else "Error"),
        "param": param,
        "code": status,
    }


# ------------------------------------------------------------------ answers


@dataclass(frozen=True)
class Outcome:
    """What a finished (or cut) request produced, for the final body."""

    request_id: str
    created_s: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency_s: float
    first_token_latency_s: float | None = None


def _finish_reason_sglang(out: Outcome) -> dict[str, Any]:
    return {"type": "length", "length": out.completion_tokens}


def generate_meta(out: Outcome, *, finished: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": _finish_reason_sglang(out) if finished else None,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "e2e_latency": out.e2e_latency_s,
        "specgov_sim": FILLER_NOTE,
    }
    # SGLang 0.5.23 adds this on the last answer when metrics are on (the sim-server
    # serves them): TokenizerManager via ReqTimeStats.convert_to_output_meta_info.
    if finished and out.first_token_latency_s is not None:
        meta["first_token_latency"] = out.first_token_latency_s
    return meta


def generate_body(out: Outcome, *, finished: bool = True) -> dict[str, Any]:
    """``/generate``'s answer, or a streamed chunk (cumulative text, as SGLang streams by
    default: ``incremental_streaming_output`` off)."""
    n = out.completion_tokens
    return {
        "text": filler_text(0, n),
        "output_ids": filler_ids(0, n),
        "meta_info": generate_meta(out, finished=finished),
    }


def usage_body(out: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def _openai_head(spec: GenSpec, out: Outcome, kind: str) -> dict[str, Any]:
    return {
        "id": out.request_id,
        "object": kind,
        "created": out.created_s,
        "model": spec.model,
        "system_fingerprint": FILLER_NOTE,
    }


def openai_body(spec: GenSpec, out: Outcome) -> dict[str, Any]:
    """The whole ``/v1/completions`` or ``/v1/chat/completions`` answer."""
    text = filler_text(0, out.completion_tokens)
    if spec.endpoint == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": None},
            "logprobs": None,
            "finish_reason": "length",
            "matched_stop": None,
        }
        kind = "chat.completion"
    else:
        echo = spec.prompt_text or ""
        choice = {
            "index": 0,
            "text": echo + text,
            "logprobs": None,
            "finish_reason": "length",
            "matched_stop": None,
        }
        kind = "text_completion"
    return {
        **_openai_head(spec, out, kind),
        "choices": [choice],
        "usage": usage_body(out),
    }


def openai_chunk(
    spec: GenSpec,
    out: Outcome,
    *,
    start: int,
    count: int,
    finished: bool,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: the ``count`` tokens from ``start`` (0 with ``role``: the chat
    stream's first chunk, which carries only the assistant role)."""
    text = filler_text(start, count)
    if spec.endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        if start == 0 and spec.prompt_text:
            text = spec.prompt_text + text
        choice = {"index": 0, "text": text, "logprobs": None}
        kind = "text_completion"
    choice["finish_reason"] = "length" if finished else None
    choice["matched_stop"] = None
    return {
        **_openai_head(spec, out, kind),
        "choices": [choice],
        "usage": None,
    }


def openai_usage_chunk(spec: GenSpec, out: Outcome) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    kind = "chat.completion.chunk" if spec.endpoint == "chat" else "text_completion"
    return {
        **_openai_head(spec, out, kind),
        "choices": [],
        "usage": usage_body(out),
    }


def models_body(model_ids: Sequence[str], *, created_s: int, max_model_len: int) -> dict[str, Any]:
    """``/v1/models``: the served model (SGLang lists ``served_model_name``)."""
    return {
        "object": "list",
        "data": [
            {
                "id": mid,
                "object": "model",
                "created": created_s,
                "owned_by": "sglang",
                "root": mid,
                "parent": None,
                "max_model_len": max_model_len,
            }
            for mid in model_ids
        ],
    }
