"""Errors a user can cause. The CLI prints their message (no traceback) and exits with status 2."""


class ZplanError(Exception):
    """Base class: the message says what is wrong and what to do."""


class ModelLoadError(ZplanError):
    """The model file cannot be imported, lacks build_model, or does not build a Module."""


class TraceError(ZplanError):
    """No tracing method could turn the model into a graph."""


class FamilySpecError(ZplanError):
    """A family spec such as 'gpt:layers=96,...' is malformed."""


class ClusterError(ZplanError):
    """Unknown cluster profile, malformed cluster file, or a GPU count the cluster cannot host."""


class SpecError(ZplanError):
    """Contradicting pins, a batch that does not divide, or another impossible request."""


class InfeasibleError(ZplanError):
    """No configuration fits; the message names the closest one and what would make it fit."""


class PlanMismatchError(ZplanError):
    """The plan was made for another model, world size or torch."""


class CheckpointError(ZplanError):
    """No usable checkpoint where one was asked for, or one that does not fit the model."""


class ExportError(ZplanError):
    """The export's output cannot be written, or the checkpoint holds something safetensors cannot."""


class SwapError(ZplanError):
    """The NVMe swap folder is full or unusable, or a swapped tensor's file is missing, truncated or corrupted."""


class OutputError(ZplanError):
    """An output path that cannot be written (checked before a run starts), or a write that failed."""


class RunLockError(ZplanError):
    """Another run holds the lock of the checkpoint folder (runtime/checkpoint/run_lock.py)."""


def short_repr(value: object, limit: int = 80) -> str:
    """A bounded repr of `value`: nested and repeated data (a YAML alias bomb) is cut, never expanded."""
    import reprlib

    shortener = reprlib.Repr()
    shortener.maxlevel, shortener.maxlist, shortener.maxdict, shortener.maxstring = 2, 4, 4, limit
    shortener.maxother = shortener.maxlong = limit
    text = shortener.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def validation_message(error, limit: int = 3) -> str:
    """A pydantic ValidationError as one line naming each field, its value and what is wrong (the first `limit`
    errors). Never str(error): pydantic's text reprs the whole input, which an alias bomb makes endless."""
    problems = []
    for item in error.errors(include_url=False)[:limit]:
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        value = f" = {short_repr(item['input'])}" if item["type"] != "missing" else ""
        problems.append(f"{field}{value}: {item['msg'].removeprefix('Value error, ')}")
    more = error.error_count() - len(problems)
    return "; ".join(problems) + (f" (and {more} more)" if more > 0 else "")
