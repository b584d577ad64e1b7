"""The launcher of the emitted launch scripts: torchrun, with a worker's error and exit status passed through once.

    python -m zplan.runtime.launch.torchrun [torchrun's options] train.py [its arguments]

torchrun (torch.distributed.run) runs in this process as it would on its own; only the end of a failed run
differs. torchrun turns any worker's failure into its own exit status 1 and a ChildFailedError traceback. Here:
  - a worker that stops on an error its user can fix (zplan's errors, bad arguments: exit status 2) writes its
    message into its torchelastic error file (report_error) rather than on stderr; the launcher prints each distinct
    message once, however many ranks had it;
  - the launcher exits with the exit status of the worker that failed first (2 for those errors; 128 + N for a
    worker killed by signal N, as a shell does), without a traceback; a crashed worker has printed its own
    traceback, and the launcher adds one line naming its rank and status.
A worker under plain torchrun (no ZPLAN_LAUNCHER in its environment) prints its message itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each worker
LAUNCHER_ENV = "ZPLAN_LAUNCHER"  # this launcher's pid, for its workers: it prints their messages (and see
# runtime.launch.distributed.die_with_launcher)
USER_ERROR_STATUS = 2


def report_error(message: str, status: int = USER_ERROR_STATUS) -> int:
    """A worker's error its user can fix: `zplan: error: message` on stderr, or, under this launcher, into the error
    file the launcher reads (it prints it once for all ranks). Returns `status`, the process's exit status."""
    line = f"zplan: error: {message}"
    path = os.environ.get(ERROR_FILE_ENV)
    if path and os.environ.get(LAUNCHER_ENV):
        try:
            Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
            return status
        except OSError:
            pass
    print(line, file=sys.stderr, flush=True)
    return status


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are reported by report_error (once through the launcher, exit status 2)."""

    def error(self, message: str):
        sys.exit(report_error(f"{self.prog}: {message} (see --help)"))


def exit_status(code: int) -> int:
    """A worker's exit code as a shell reports it: 128 + N for a worker killed by signal N."""
    return 128 - code if code < 0 else code


def describe_failures(failures: dict) -> tuple[list[str], int]:
    """(lines to print, exit status) of torchrun's failures (global rank -> ProcessFailure): each distinct message
    a worker reported once, a line for each worker that failed without one, the first failure's status."""
    first = min(failures, key=lambda rank: failures[rank].timestamp)
    lines: list[str] = []
    for rank in sorted(failures):
        failure = failures[rank]
        message = failure.message if isinstance(failure.message, str) else ""
        if message.startswith("zplan: error: "):
            if message not in lines:
                lines.append(message)
        elif failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name if -failure.exitcode in signal.valid_signals() else "?"
            lines.append(f"zplan: rank {rank} was killed by signal {-failure.exitcode} ({name})")
        else:
            lines.append(f"zplan: rank {rank} exited with status {failure.exitcode} (its output above says why)")
    return lines, exit_status(failures[first].exitcode)


def _not_the_failure_record(record: logging.LogRecord) -> bool:
    """torchrun's log line of the first failure, which the launcher's own report replaces."""
    return not str(record.msg).startswith("failed (exitcode")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ[LAUNCHER_ENV] = str(os.getpid())
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_not_the_failure_record)
    try:
        run(parse_args(argv))
    except ChildFailedError as error:
        lines, status = describe_failures(error.failures)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return status
    except SignalException as error:  # torchrun stopped its workers on SIGTERM / SIGINT / SIGHUP
        return 128 + int(error.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
