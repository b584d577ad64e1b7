"""One rank of the dry run's honesty check (tests/distributed/test_dry_run_vs_real.py): the plan in OUT run for
real, in a real gloo process group on real tensors, through the same measure_steps and meter as the dry run.

    python dry_run_worker.py OUT MODEL_FILE RESULT_PREFIX     # as one rank of torchrun's world
writes RESULT_PREFIX.rank<r>.json: the figures of runtime.dryrun.dry_run.RankFigures.
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

from zplan.dryrun import DRYRUN_STEPS, load_program
from zplan.runtime.dryrun.dry_run import measure_steps
from zplan.runtime.launch.distributed import run_distributed


def main(out_dir: str, model_path: str, prefix: str) -> None:
    program = load_program(Path(out_dir), Path(model_path))

    def work(ctx) -> None:
        figures = measure_steps(program.plan, program.model_path, program.settings, DRYRUN_STEPS, ctx,
                                say=lambda message: None, fake=False)
        Path(f"{prefix}.rank{ctx.rank}.json").write_text(json.dumps(asdict(figures)))

    run_distributed(work)


if __name__ == "__main__":
    main(*sys.argv[1:4])
