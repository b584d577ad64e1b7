"""The inference server's requests (runtime/inference/server.py): their bounds (ServerLimits), the pydantic models of
the OpenAI-compatible bodies (POST /v1/completions, POST /v1/chat/completions), and the message of a 400 that names
each bad field and what it accepts.

The models are the one place a request's bounds are written: strict types (no "5" for 5, no true for 1, no [5]), no
NaN or infinity, unknown fields refused; allowed_values describes each field from its type and bounds (or from the
"accepts" text of a field whose type is not a plain number, string or boolean)."""

import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

MIN_QUEUE = 256  # default queue size at least: a waiting request holds only its token ids


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may ask; the engine's own limits come from the engine."""

    max_new_tokens: int  # largest max_tokens accepted (max_seq_len - 1: a prompt has at least one token)
    default_max_new_tokens: int  # when a request gives none (the plan's gen_len; less when the prompt leaves less room)
    max_prompt_chars: int  # characters of prompt (all of a chat's messages together) accepted before tokenizing
    max_body_bytes: int = 1 << 20  # request bodies above this get 413
    max_temperature: float = 10.0  # finite; a temperature below sampling.MIN_TEMPERATURE is greedy
    queue_size: int = 64  # requests waiting for the worker; more get 429
    retry_after_s: int = 1  # Retry-After of a 429 or 503
    max_connections: int = 256  # open connections; one more is answered 503 and closed
    header_timeout_s: float = 10.0  # a request's headers complete within this (else 408)
    body_timeout_s: float = 30.0  # a request's body read within this after its headers (else 408)
    max_stop_strings: int = 4  # stop strings per request (OpenAI's limit)
    max_logprobs: int = 5  # largest completions `logprobs` (OpenAI's limit; only the chosen token's is returned)

    @classmethod
    def for_engine(cls, max_seq_len: int, max_batch: int, default_max_new_tokens: int, max_chars_per_token: int = 1,
                   **overrides: Any):
        default = max(1, min(default_max_new_tokens, max_seq_len - 1))
        # a token holds at most max_chars_per_token characters (the byte tokenizer 1; a Hugging Face one its longest
        # token's): a prompt of more than max_seq_len of them cannot fit, so it is refused before tokenizing
        return cls(max_new_tokens=max(1, max_seq_len - 1), default_max_new_tokens=default,
                   max_prompt_chars=max_seq_len * max(1, max_chars_per_token),
                   **{"queue_size": max(MIN_QUEUE, 8 * max_batch), **overrides})


def _accepts(text: str) -> dict:
    """Field(json_schema_extra=...) giving what a field accepts, in words, for allowed_values."""
    return {"accepts": text}


def _only(value: Any, what: str):
    """A field validator refusing any value but None and `value` ("true is not supported")."""

    def check(cls, given):
        if given is not None and given != value:
            raise PydanticCustomError("unsupported", "{what} is not supported", {"what": what})
        return given

    return check


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Union[str, None] = None  # accepted, ignored

    def text(self) -> str:
        """The message's text: its string, or its text parts joined."""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


def _sampling_fields(limits: ServerLimits) -> dict[str, Any]:
    """The fields both endpoints share: (annotation, Field) by name."""
    stop_text = Annotated[str, Field(min_length=1)]
    stops = Annotated[list[stop_text], Field(min_length=1, max_length=limits.max_stop_strings)]
    zero = "must be 0 or null (penalties are not supported)"
    return {
        "model": (Union[str, None], Field(default=None, json_schema_extra=_accepts(
            "model must be a string, the name GET /v1/models lists, or null"))),
        "max_tokens": (Union[int, None], Field(default=None, ge=1, le=limits.max_new_tokens,
                                                 description="Most tokens to generate.")),
        "temperature": (Union[float, None], Field(default=None, ge=0.0, le=limits.max_temperature,
                                                    description="Softmax temperature (default 1); below 1e-5 greedy.")),
        "top_p": (Union[float, None], Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling mass.")),
        "stop": (Union[stop_text, stops, None], Field(default=None, json_schema_extra=_accepts(
            f"stop must be a non-empty string, a list of 1 to {limits.max_stop_strings} non-empty strings, "
            "or null"))),
        "seed": (Union[int, None], Field(default=None, ge=0, le=2**63 - 1, description="Sampling seed.")),
        "n": (Union[int, None], Field(default=None, ge=1, le=1, json_schema_extra=_accepts(
            "n must be 1 (one choice per request) or null"))),
        "stream": (Union[bool, None], Field(default=None, description="Answer server-sent events.")),
        "stream_options": (Union[StreamOptions, None], Field(default=None, json_schema_extra=_accepts(
            'stream_options must be {"include_usage": true or false} (with stream true) or null'))),
        "user": (Union[str, None], Field(default=None, description="Accepted, ignored.")),
        "presence_penalty": (Union[float, None], Field(default=None, ge=0.0, le=0.0, json_schema_extra=_accepts(
            f"presence_penalty {zero}"))),
        "frequency_penalty": (Union[float, None], Field(default=None, ge=0.0, le=0.0, json_schema_extra=_accepts(
            f"frequency_penalty {zero}"))),
    }


STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def completion_request_model(limits: ServerLimits) -> type[BaseModel]:
    """The POST /v1/completions body, bounded by `limits`."""
    text = Annotated[str, Field(min_length=1, max_length=limits.max_prompt_chars)]
    one = Annotated[list[text], Field(min_length=1, max_length=1)]
    fields = _sampling_fields(limits)
    fields["prompt"] = (Union[text, one], Field(json_schema_extra=_accepts(
        f"prompt must be a string of 1 to {limits.max_prompt_chars} characters, or a list of exactly one such "
        "string")))
    fields["logprobs"] = (Union[int, None], Field(default=None, ge=0, le=limits.max_logprobs, description=(
        "Return the chosen tokens' log-probabilities.")))
    fields["echo"] = (Union[bool, None], Field(default=None, json_schema_extra=_accepts(
        "echo must be false or null (the prompt is not echoed)")))
    order = ["model", "prompt", *[name for name in fields if name not in ("model", "prompt")]]

    from pydantic import create_model

    return create_model("CompletionRequest", __config__=STRICT,
                        __validators__={"echo_false": field_validator("echo")(_only(False, "true"))},
                        **{name: fields[name] for name in order})


def chat_request_model(limits: ServerLimits) -> type[BaseModel]:
    """The POST /v1/chat/completions body, bounded by `limits`."""
    from pydantic import create_model

    fields = _sampling_fields(limits)
    fields["messages"] = (Annotated[list[ChatMessage], Field(min_length=1)], Field(json_schema_extra=_accepts(
        'messages must be a list of one or more {"role": "system", "user" or "assistant", "content": a string or '
        'a list of {"type": "text", "text": a string}}')))
    fields["max_completion_tokens"] = (Union[int, None], Field(default=None, ge=1, le=limits.max_new_tokens,
                                                                 description="Most tokens to generate."))
    fields["logprobs"] = (Union[bool, None], Field(default=None, description="Return the chosen tokens' "
                                                                                "log-probabilities."))
    fields["top_logprobs"] = (Union[int, None], Field(default=None, ge=0, le=20, description=(
        "Accepted; only the chosen token's log-probability is returned.")))
    order = ["model", "messages", *[name for name in fields if name not in ("model", "messages")]]
    return create_model("ChatCompletionRequest", __config__=STRICT, **{name: fields[name] for name in order})


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _optional(annotation) -> tuple[Any, bool]:
    """(the type, whether null is accepted) of X or Optional[X]."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def allowed_values(model: type[BaseModel]) -> dict[str, str]:
    """What each field of `model` accepts, in words, from its type and bounds (so a bound is written once, in the
    model), or its "accepts" text: {"temperature": "temperature must be a finite number, 0 <= temperature <= 10,
    or null", ...}."""
    import annotated_types as at

    kinds = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}
    allowed = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if "accepts" in extra:
            allowed[name] = str(extra["accepts"])
            continue
        kind, nullable = _optional(info.annotation)
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
        text = f"{name} must be {kinds.get(kind, str(kind))}"
        if kind is str and (low or high):
            text += f" of {low or 0} to {high} characters" if high else f" of at least {low} characters"
        elif low or high:
            text += f", {low}{name}{high}"
        allowed[name] = text + (", or null" if nullable else "")
    return allowed


def _path(loc: tuple) -> str:
    """("messages", 0, "role") -> "messages[0].role"."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


NESTED_FIELDS = {*ChatMessage.model_fields, *TextPart.model_fields, *StreamOptions.model_fields}


def _where(loc: tuple, unknown: bool) -> str:
    """The place an error's location names in the body, without the union members' tags ("str", "list[...]");
    `unknown`: its last part is an unknown field's name, kept."""
    last = len(loc) - 1 if unknown else -1
    return _path(tuple(part for i, part in enumerate(loc)
                       if i in (0, last) or isinstance(part, int) or part in NESTED_FIELDS))


def validation_message(error: ValidationError, allowed: dict[str, str]) -> tuple[str, str | None]:
    """(message, param) of a request body that `error` refused: one line per bad field, naming it, what was wrong
    and what it accepts (`allowed`: allowed_values of the model); param is the first bad field (None when the
    body itself is not a JSON object)."""
    by_field: dict[str, list[dict]] = {}
    for e in error.errors(include_url=False):
        by_field.setdefault(str(e["loc"][0]) if e["loc"] else "", []).append(e)
    lines = []
    for name, errors in by_field.items():
        # a union reports one error per member: the member whose type matched says more than a type mismatch
        e = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        if not name:
            lines.append(f"the request body is not valid JSON ({e['msg']})" if e["type"] == "json_invalid" else
                         "the request body must be a JSON object")
        elif e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            lines.append(f"{name}: unknown field; the fields are {', '.join(allowed)}")
        else:
            accepts = allowed.get(name, f"the fields are {', '.join(allowed)}")
            lines.append(f"{_where(tuple(e['loc']), e['type'] == 'extra_forbidden')}: {e['msg']}; {accepts}")
    return "\n".join(lines), next((name for name in by_field if name), None)
