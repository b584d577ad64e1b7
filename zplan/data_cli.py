"""`zplan data prepare INPUT... --tokenizer DIR -o tokens.bin`: text, JSON-lines or saved-dataset inputs tokenized into
a token file and its sidecar (zplan.runtime.data.prepare), with a progress bar, for train.py --data.

Registered in zplan/cli.py as the `data` sub-command group. User errors (ZplanError) print one message on stderr, no
traceback, and exit with status 2; nothing is written then.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from zplan.errors import ZplanError
from zplan.out_dir import check_out_file

data_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                       help="Prepare training data for train.py --data.")
err = Console(stderr=True)
out = Console()


@data_app.command("prepare")
def prepare_command(
    inputs: list[Path] = typer.Argument(..., metavar="INPUT",
                                        help="Text files (a document per line), .jsonl files (a \"text\" field per "
                                             "line) or datasets folders (save_to_disk), in this order."),
    tokenizer: Path = typer.Option(..., "--tokenizer", metavar="DIR",
                                   help="A Hugging Face tokenizer folder (what tokenizer.save_pretrained wrote)."),
    output: Path = typer.Option(..., "-o", "--out", metavar="FILE",
                                help="The token file to write (its sidecar FILE.json beside it)."),
) -> None:
    """Tokenize INPUT... into one token file (uint16 or uint32 ids, each document followed by the tokenizer's
    end-of-sequence token) and its JSON sidecar, using all cores; the same inputs write the same bytes."""
    from zplan.runtime.data.prepare import prepare, total_size  # start-up time: numpy and transformers

    try:
        check_out_file(output, "-o")
        total = total_size(inputs) if all(p.exists() for p in inputs) else None
        columns = [TextColumn("tokenizing"), BarColumn(), DownloadColumn() if total else TextColumn(""),
                   TextColumn("{task.fields[tokens]:,} tokens"), TimeRemainingColumn()]
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task("prepare", total=total, tokens=0)

            def advance(units: int, tokens: int) -> None:
                bar.update(task, advance=units, tokens=bar.tasks[task].fields["tokens"] + tokens)

            done = prepare(inputs, tokenizer, output, progress=advance)
    except ZplanError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True, markup=True)
        raise typer.Exit(code=2) from None
    out.print(f"wrote {done.path} ({done.tokens:,} {done.dtype} tokens, {done.documents:,} documents) and "
              f"{done.path}.json in {done.seconds:.2f} s: {done.tokens_per_s:,.0f} tokens/s", highlight=False,
              soft_wrap=True)
