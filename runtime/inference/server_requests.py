"""The inference server's requests (runtime/inference/server.py): their bounds (ServerLimits), the pydantic model
of a POST /v1/generate body, and the 422 answer that names each bad field and what it accepts."""

import math
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may ask; the engine's own limits come from the engine."""

    max_new_tokens: int  # largest max_new_tokens accepted (max_seq_len - 1: a prompt has at least one token)
    default_max_new_tokens: int  # when a request gives none (the plan's gen_len)
    max_prompt_chars: int  # characters of prompt accepted before tokenizing
    max_body_bytes: int = 1 << 20  # request bodies above this get 413
    max_temperature: float = 10.0  # finite; a temperature below sampling.MIN_TEMPERATURE is greedy
    queue_size: int = 64  # requests waiting for the worker; more get 503
    retry_after_s: int = 1  # Retry-After of a 503
    batch_wait_s: float = 0.002  # after the first request of a batch, wait this long for more
    max_connections: int = 256  # open connections; one more is answered 503 and closed
    header_timeout_s: float = 10.0  # a request's headers complete within this (else 408)
    body_timeout_s: float = 30.0  # a request's body read within this after its headers (else 408)

    @classmethod
    def for_engine(cls, max_seq_len: int, max_batch: int, default_max_new_tokens: int, max_chars_per_token: int = 1,
                   **overrides: Any):
        default = max(1, min(default_max_new_tokens, max_seq_len - 1))
        # a token holds at most max_chars_per_token characters (the byte tokenizer 1; a Hugging Face one its longest
        # token's): a prompt of more than max_seq_len of them cannot fit, so it is refused before tokenizing
        return cls(max_new_tokens=max(1, max_seq_len - 1), default_max_new_tokens=default,
                   max_prompt_chars=max_seq_len * max(1, max_chars_per_token),
                   **{"queue_size": 8 * max_batch, **overrides})


def request_model(limits: ServerLimits) -> type[BaseModel]:
    """The POST /v1/generate body, bounded by `limits`; strict types (no "5" for 5, no true for 1, no lists),
    no NaN or infinity, unknown fields refused. The one place the request's bounds are written: a 422 describes
    them from here (allowed_values), and every endpoint that samples parses its body with this model."""

    class GenerateRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

        prompt: str = Field(min_length=1, max_length=limits.max_prompt_chars, description="Text to continue.")
        max_new_tokens: int = Field(default=limits.default_max_new_tokens, ge=1, le=limits.max_new_tokens,
                                    description="Most tokens to generate.")
        temperature: float = Field(default=0.0, ge=0.0, le=limits.max_temperature,
                                   description="Softmax temperature; 0 (any value below 1e-5) is greedy.")
        top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
        seed: int = Field(default=0, ge=0, le=2**63 - 1, description="Sampling seed of this request.")
        stream: bool = Field(default=False, description="Answer NDJSON, one line per token.")

    return GenerateRequest


def json_safe(value: Any) -> Any:
    """`value` as JSON can carry it: NaN and infinities as text, bytes decoded (invalid UTF-8 replaced), other
    objects as their str; so that an error about a bad value can itself be rendered."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def allowed_values(model: type[BaseModel]) -> dict[str, str]:
    """What each field of `model` accepts, in words, from its type and bounds (so a bound is written once, in the
    model): {"temperature": "temperature must be a finite number, 0 <= temperature <= 10", ...}."""
    import annotated_types as at

    kinds = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}
    allowed = {}
    for name, info in model.model_fields.items():
        low = high = ""
        for bound in info.metadata:
            if isinstance(bound, at.Ge):
                low = f"{_number(bound.ge)} <= "
            elif isinstance(bound, at.Gt):
                low = f"{_number(bound.gt)} < "
            elif isinstance(bound, at.Le):
                high = f" <= {_number(bound.le)}"
            elif isinstance(bound, at.Lt):
                high = f" < {_number(bound.lt)}"
            elif isinstance(bound, at.MinLen):
                low = f"{bound.min_length}"
            elif isinstance(bound, at.MaxLen):
                high = f"{bound.max_length}"
        text = f"{name} must be {kinds.get(info.annotation, str(info.annotation))}"
        if info.annotation is str and (low or high):
            text += f" of {low or 0} to {high} characters" if high else f" of at least {low} characters"
        elif low or high:
            text += f", {low}{name}{high}"
        allowed[name] = text
    return allowed


def validation_response(error: ValidationError, allowed: dict[str, str] | None = None) -> JSONResponse:
    """422 in FastAPI's format ({"detail": [{"type", "loc", "msg", "input", "ctx"}, ...]}), every value JSON. With
    `allowed` (allowed_values of the model), each msg names its field and what the field accepts."""
    errors = []
    for e in error.errors(include_url=False):
        field_name = e["loc"][0] if e["loc"] else None
        if allowed is not None and isinstance(field_name, str):
            accepts = allowed.get(field_name, f"the fields are {', '.join(allowed)}")
            e = {**e, "msg": f"{field_name}: {e['msg']}; {accepts}"}
        errors.append({**e, "loc": ["body", *e["loc"]]})
    return JSONResponse({"detail": json_safe(errors)}, status_code=422)
