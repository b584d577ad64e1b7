"""What the emitted generate.py and serve.py run: their command lines, the prompts, and the output.

    generate_main(plan_path, model_path, settings, default_max_new_tokens)  # prompts (file/stdin) -> completions
    serve_main(plan_path, model_path, settings, default_max_new_tokens)     # the HTTP server (runtime.inference.server)

Both return the process's exit status: 0, or 2 with a one-line message (no traceback) for an error the user
can fix (a plan that does not match, a bad prompt file, a prompt too long for the KV cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from zplan.errors import SpecError, ZplanError
from zplan.runtime.inference.batching import default_blocks
from zplan.runtime.inference.build import (
    EngineSettings,
    check_inference_plan,
    engine_from_plan,
    load_inference_plan,
)
from zplan.runtime.inference.sampling import SamplingParams
from zplan.runtime.inference.server import ServerLimits, serve
from zplan.runtime.inference.tokenizer import load_tokenizer
from zplan.runtime.launch.arguments import MAX_SEED
from zplan.runtime.launch.distributed import run_distributed
from zplan.runtime.launch.torchrun import ArgumentParser, report_error


def _common_arguments(parser: argparse.ArgumentParser, default_max_new_tokens: int) -> None:
    parser.add_argument("--weights", metavar="PATH",
                        help="model weights: a .safetensors file, a Hugging Face folder (`zplan export --hf`, "
                             "save_pretrained) or train.py --save-weights' file (default: the model's own folder's "
                             "weights when it is a Hugging Face folder, else the seeded random initialisation: the "
                             "text is noise)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random initialisation without --weights, and of sampling, 0 to 2^32 - 1 "
                             "(default 0)")
    parser.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens,
                        help=f"tokens to generate per prompt (default {default_max_new_tokens}, the plan's gen_len)")
    parser.add_argument("--nvme-path", metavar="DIR", help="folder on a local NVMe drive for the streamed weights' "
                        "files (plans whose weights live on NVMe)")
    parser.add_argument("--model", metavar="PATH", help="model file (default: MODEL_FILE of the script)")


def _model_file(args: argparse.Namespace, default: Path | None) -> Path | None:
    """--model when given, else the script's MODEL_FILE."""
    return Path(args.model) if args.model else default


def _error(message: str) -> int:
    """`zplan: error: message` once (through zplan's launcher under tensor parallel: runtime/launch/torchrun.py);
    status 2."""
    return report_error(message)


def _check_common_arguments(args: argparse.Namespace) -> None:
    """SpecError for a seed torch's generator cannot tell from another (runtime.launch.arguments.MAX_SEED) or an empty
    path (taken as not given, or as the current folder)."""
    if not 0 <= args.seed <= MAX_SEED:
        raise SpecError(f"--seed {args.seed}: must be 0 to {MAX_SEED:,} (torch's generator keeps a seed's low 32 "
                        "bits: a larger or negative seed would draw another seed's numbers)")
    for option in ("--weights", "--model", "--nvme-path", "--prompts"):
        if getattr(args, option[2:].replace("-", "_"), None) == "":
            raise SpecError(f"{option} '': give a path, not an empty string")


# ---- generate.py ---------------------------------------------------------------------------------------------


def read_prompts(path: str | None) -> list[str]:
    """Prompts one per line from `path` (None or '-': stdin); blank lines are skipped. SpecError when none."""
    source = "standard input" if path in (None, "-") else path
    try:
        text = sys.stdin.read() if path in (None, "-") else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read the prompts from {source}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"{source} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SpecError(f"no prompts in {source}: give one prompt per line (--prompts FILE, or on standard input)")
    return prompts


def check_lengths(prompt_ids: list[list[int]], max_new_tokens: int, max_seq_len: int) -> None:
    """SpecError naming the first prompt whose tokens + max_new_tokens exceed max_seq_len."""
    if max_new_tokens < 1:
        raise SpecError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if max_new_tokens >= max_seq_len:
        raise SpecError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt: the KV cache holds "
                        f"max_seq_len = {max_seq_len} tokens per sequence (prompt + generated)")
    for number, ids in enumerate(prompt_ids, start=1):
        if len(ids) + max_new_tokens > max_seq_len:
            raise SpecError(f"prompt {number} has {len(ids)} tokens: with --max-new-tokens {max_new_tokens} that is "
                            f"over max_seq_len = {max_seq_len} (prompt + generated tokens per sequence); shorten it "
                            f"to at most {max_seq_len - max_new_tokens} tokens or ask for fewer new tokens")


def escape_line(text: str) -> str:
    """One completion on one line: backslash, newline and carriage return written as \\\\, \\n, \\r."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _generate_parser(default_max_new_tokens: int) -> argparse.ArgumentParser:
    parser = ArgumentParser(description="Generate a completion for each prompt (one per line), in batches.")
    parser.add_argument("--prompts", metavar="FILE", help="prompts, one per line (default: standard input)")
    _common_arguments(parser, default_max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="softmax temperature, 0 to 10; 0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 0 < p <= 1 (default 1)")
    parser.add_argument("--batch", type=int, help="prompts per engine batch (default and most: the plan's max batch)")
    parser.add_argument("--tokens", action="store_true", help="print the generated token ids instead of the text")
    return parser


MAX_TEMPERATURE = 10.0  # as for the server's requests (runtime.inference.server.ServerLimits.max_temperature)


def check_generate_arguments(args: argparse.Namespace) -> None:
    """SpecError naming the first of generate.py's options outside its range (before any work)."""
    _check_common_arguments(args)
    if not 0.0 <= args.temperature <= MAX_TEMPERATURE:  # NaN is never in range
        raise SpecError(f"--temperature {args.temperature}: must be 0 (greedy) to {MAX_TEMPERATURE:g}")
    if not 0.0 < args.top_p <= 1.0:
        raise SpecError(f"--top-p {args.top_p}: must be 0 < top-p <= 1")


def _share_prompts(prompt_ids: list[list[int]] | None, world_size: int) -> list[list[int]]:
    """Rank 0's prompts on every rank of the tensor-parallel group (only rank 0 reads the input)."""
    if world_size == 1:
        return prompt_ids
    import torch.distributed as dist

    box = [prompt_ids]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_generate(args: argparse.Namespace, plan_path: Path, model_path: Path | None,
                 settings: EngineSettings) -> None:
    plan = load_inference_plan(plan_path)
    if args.batch is not None and not 1 <= args.batch <= settings.max_batch:
        raise SpecError(f"--batch {args.batch}: the engine runs 1 to {settings.max_batch} (the plan's max batch) "
                        "sequences at a time")
    # the plan against the model file and launch, before reading any input (engine_from_plan checks again)
    check_inference_plan(plan, model_path, int(os.environ.get("WORLD_SIZE", "1")), settings.tp)
    prompt_ids = None
    if int(os.environ.get("RANK", "0")) == 0:  # only rank 0 reads the input; an error stops the run before the engine
        tokenizer = load_tokenizer(model_path, plan.model.vocab)  # a Hugging Face folder's own, else bytes
        prompt_ids = [tokenizer.encode(p) for p in read_prompts(args.prompts)]
        check_lengths(prompt_ids, args.max_new_tokens, settings.max_seq_len)

    engine, tokenizer, ctx = engine_from_plan(plan, model_path, weights=args.weights, seed=args.seed,
                                              nvme_dir=args.nvme_path, settings=settings)
    try:
        prompt_ids = _share_prompts(prompt_ids, ctx.world_size)
        batch = args.batch or engine.max_batch
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                  stop_token=tokenizer.eos_id)
        start, generated = time.perf_counter(), 0
        for first in range(0, len(prompt_ids), batch):
            chunk = prompt_ids[first:first + batch]
            outputs = engine.generate(chunk, args.max_new_tokens, [sampling] * len(chunk))
            generated += sum(len(tokens) for tokens in outputs)
            if ctx.is_main:
                for tokens in outputs:
                    if args.tokens:
                        print(" ".join(str(t) for t in tokens), flush=True)
                    else:
                        print(escape_line(tokenizer.decode([t for t in tokens if t != tokenizer.eos_id])), flush=True)
        elapsed_s = time.perf_counter() - start
        if ctx.is_main:
            print(f"zplan: {len(prompt_ids)} prompt(s), {generated} tokens generated in {elapsed_s:.2f} s "
                  f"({generated / max(elapsed_s, 1e-9):.1f} tokens/s; batches of up to {batch})",
                  file=sys.stderr, flush=True)
    finally:
        engine.close()


def generate_main(plan_path: Path, model_path: Path | None, settings: EngineSettings, default_max_new_tokens: int,
                  argv: list[str] | None = None) -> int:
    """generate.py: completions of the prompts, one line each, on rank 0's standard output."""
    args = _generate_parser(default_max_new_tokens).parse_args(argv)
    try:
        check_generate_arguments(args)  # before the process group and the engine
        run_distributed(lambda ctx: run_generate(args, plan_path, _model_file(args, model_path), settings))
    except ZplanError as error:
        return _error(str(error))
    return 0


# ---- serve.py ------------------------------------------------------------------------------------------------


def _serve_parser(default_max_new_tokens: int) -> argparse.ArgumentParser:
    parser = ArgumentParser(description="Serve an OpenAI-compatible API over HTTP: POST /v1/completions, "
                            "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    _common_arguments(parser, default_max_new_tokens)
    parser.add_argument("--queue-size", type=int, help="requests waiting beyond which the server answers 429 "
                        "(default: 8 x the plan's max batch, at least 256)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    parser.add_argument("--max-connections", type=int, default=256,
                        help="open connections at most; one more is answered 503 and closed (default 256)")
    parser.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                        help="seconds a request's headers may take to arrive, else 408 (default 10)")
    parser.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                        help="seconds a request's body may take to arrive after its headers, else 408 (default 30)")
    parser.add_argument("--api-key", default=os.environ.get("ZPLAN_API_KEY") or None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` on every endpoint but /health (default: "
                             "$ZPLAN_API_KEY; none: no key needed)")
    parser.add_argument("--model-name", metavar="NAME", help="the model's name in the API (GET /v1/models, the "
                        "requests' \"model\"; default: the model folder's or file's name)")
    return parser


def served_model_name(args: argparse.Namespace, model_path: Path | None) -> str:
    """--model-name, else the model folder's name or the model file's name without its suffix, else "zplan"."""
    if args.model_name:
        return args.model_name
    if model_path is None:
        return "zplan"
    return model_path.name if model_path.is_dir() else model_path.stem


# (option, attribute, lowest, highest) of the server's numeric options
SERVE_BOUNDS = (("--port", "port", 1, 65535), ("--queue-size", "queue_size", 1, 1_000_000),
                ("--max-body-bytes", "max_body_bytes", 1, 1 << 30),
                ("--max-connections", "max_connections", 1, 100_000),
                ("--header-timeout", "header_timeout", 1e-3, 3600.0),
                ("--body-timeout", "body_timeout", 1e-3, 3600.0))


def check_serve_arguments(args: argparse.Namespace) -> None:
    """SpecError naming the first server option outside its range (before the engine is built)."""
    _check_common_arguments(args)
    if not args.host.strip():  # the empty host would listen on every interface of the machine
        raise SpecError(f"--host {args.host!r}: give an address to listen on (127.0.0.1, the default: this machine "
                        "only; 0.0.0.0: all interfaces)")
    for option, name, low, high in SERVE_BOUNDS:
        value = getattr(args, name)
        if value is not None and not low <= value <= high:  # NaN is never in range
            raise SpecError(f"{option} {value}: must be {low:g} to {high:g}")


def serve_main(plan_path: Path, model_path: Path | None, settings: EngineSettings, default_max_new_tokens: int,
               argv: list[str] | None = None) -> int:
    """serve.py: the HTTP server on rank 0, the batch followers on the other tensor-parallel ranks."""
    args = _serve_parser(default_max_new_tokens).parse_args(argv)
    try:
        check_serve_arguments(args)  # before the process group and the engine
        return run_distributed(lambda ctx: run_serve(args, plan_path, _model_file(args, model_path), settings))
    except ZplanError as error:
        return _error(str(error))


def run_serve(args: argparse.Namespace, plan_path: Path, model_path: Path | None, settings: EngineSettings) -> int:
    plan = load_inference_plan(plan_path)
    if not 1 <= args.max_new_tokens < settings.max_seq_len:
        raise SpecError(f"--max-new-tokens {args.max_new_tokens}: must be 1 to {settings.max_seq_len - 1} "
                        f"(max_seq_len = {settings.max_seq_len} holds prompt + generated tokens)")
    overrides = {"max_body_bytes": args.max_body_bytes, "max_connections": args.max_connections,
                 "header_timeout_s": args.header_timeout, "body_timeout_s": args.body_timeout}
    if args.queue_size is not None:
        overrides["queue_size"] = args.queue_size
    engine, tokenizer, ctx = engine_from_plan(plan, model_path, weights=args.weights, seed=args.seed,
                                              nvme_dir=args.nvme_path, settings=settings)
    limits = ServerLimits.for_engine(engine.max_seq_len, engine.max_batch, args.max_new_tokens,
                                     tokenizer.max_chars_per_token, **overrides)
    try:
        num_blocks = settings.kv_blocks or default_blocks(engine.max_batch, engine.max_seq_len)
        return serve(engine, tokenizer, ctx, args.host, args.port, limits, num_blocks=num_blocks,
                     model_name=served_model_name(args, model_path), api_key=args.api_key)
    finally:
        engine.close()
