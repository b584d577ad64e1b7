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
