"""The error of a data file, a tokenizer or a data option a user gave: one message naming the file and the fix."""

from __future__ import annotations

from zplan.errors import ZplanError


class DataError(ZplanError):
    """A data file, tokenizer folder or data option that cannot be used as given (exit status 2)."""
