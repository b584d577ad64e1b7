"""Online serving: `zplan serve` against `transformers serve --continuous-batching`, zplan's engine batching
statically, and Hugging Face generate one request at a time, on the same GPT-2-sized model and workload.

    .venv/bin/python benchmarks/serving.py [--json] [--small] [--model-folder DIR] [--requests 64] [--rate 4]
        [--skip-transformers] [--skip-hf] [--skip-static] [--skip-zplan] [--skip-soak] [--only zplan,...]
        [--soak-seconds 60] [--soak-clients 200] [--transformers-pythonpath DIR]

The model: transformers.GPT2Config() (12 layers, hidden 768, vocabulary 50257; bos/eos set to the tokenizer's)
with random weights (torch.manual_seed(0), fp32, sdpa), saved with save_pretrained beside a byte-level BPE
tokenizer of TOKENIZER_VOCAB tokens trained here on generated words (nothing is downloaded). The rows of the tied
token table past the tokenizer's vocabulary (and of its tokens that are not printable ASCII alone: <unk>, <s>,
lone UTF-8 bytes) are zeroed: their logits are then 0 while the best other logit is positive, so greedy decoding
picks tokens the tokenizer decodes to text (a random GPT-2 would otherwise answer mostly with ids the tokenizer
drops, and the texts compared below would be nearly empty). The compute is GPT-2's: the head still multiplies all
50257 rows. --small: 2 layers, hidden 64, 16 requests, a 10 s soak (about a minute end to end). The folder is
built once (--model-folder, default under the temp folder) and reused.

The workload: --requests requests arriving as a Poisson process of --rate requests/s (seeded), prompts of 16 to
256 tokens (random words of the tokenizer's training text), 16 to 128 output tokens, each
`POST /v1/completions {"prompt", "max_tokens", "temperature": 0, "stream": true, "stream_options":
{"include_usage": true}}`. Servers stop at the end-of-text token as generate does (rare with these weights);
tokens are counted from the usage chunk (else one per text chunk).

What runs (one at a time: the machine has 2 cores), each on the same folder and workload:
  hf_sequential  in process: model.generate (greedy, max_new_tokens = the request's, stopping at eos) one
                 request at a time, in virtual time (a request starts at max(its arrival, the previous end)).
                 Its texts are the greedy references.
  static         in process: zplan's InferenceEngine (max_batch 16, max_seq_len 512), engine.stream over batches of
                 up to 16 arrived requests, each batch run to its end before the next starts (virtual time).
  zplan          `zplan serve FOLDER --port P` (subprocess; /health, then the workload; SIGTERM).
  transformers   `transformers serve --continuous-batching FOLDER --port P` (the same), with a KV cache of
                 --cb-num-blocks for the whole workload (unbounded it takes 60 % of the free RAM on a CPU). It
                 loads models with a device_map, which needs the accelerate package: installed, or in a folder
                 named by --transformers-pythonpath (put on PYTHONPATH for that server only).
  soak           --soak-clients clients streaming short completions back to back for --soak-seconds against
                 zplan serve: lost requests (sent, never finished with a final chunk and [DONE], 429/503 answers
                 apart), duplicated chunks, and the server's resident memory growth after a 10 s warm-up.
Per run: throughput (completion tokens / s from the first arrival to the last end), time to first token
(TTFT, from arrival) p50 and p99, time per output token (TPOT) p50, failed requests.

JSON keys: throughput_over_transformers_serve, p99_ttft_over_transformers_serve (lower is better),
throughput_over_static, throughput_over_hf_sequential, greedy_match_fraction (zplan's completion text equals
generate's greedy text for the same prompt and max_tokens), lost, rss_growth_bytes, and each run's metrics
(keys hf_sequential, static, zplan, transformers_serve, soak), timings_s and the machine. A part that fails
(zplan serve missing, say) gets {"error": ...}, its ratios are null, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import free_port  # noqa: E402
from serving_load import Outcome, make_workload, metrics, run_workload, soak, stream_completion  # noqa: E402

BIN = Path(sys.executable).parent
HOST = "127.0.0.1"
PARTS = ("hf", "static", "zplan", "transformers", "soak")
TOKENIZER_VOCAB = 4096  # BPE tokens; the model's vocabulary stays 50257
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
STATIC_MAX_BATCH, MAX_SEQ_LEN = 16, 512  # the static engine's batch and cache length (tokens)
SMALL = dict(n_layer=2, n_embd=64, n_head=4)
SOAK_WARMUP_S = 10.0  # the soak's first RSS reading (at most half the soak)
FOLDER_STAMP, FOLDER_VERSION = "serving_benchmark.json", 2  # what built the folder; bumped when the build changes
CB_PAGE_TOKENS = 256  # transformers' continuous batching: tokens per KV cache block (its default page_size)


def progress(message: str) -> None:
    """A line on stderr while the benchmark runs (stdout carries the results)."""
    print(f"serving.py: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


class PartError(Exception):
    """A part of the benchmark could not run (the message says why)."""


# ---- the model folder ---------------------------------------------------------------------------------------


def make_words(count: int = 3000, seed: int = 0) -> list[str]:
    """`count` distinct lowercase words of 1 to 4 consonant-vowel syllables (seeded)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))))
    return sorted(words)


def train_tokenizer(words: list[str]):
    """A byte-level BPE of TOKENIZER_VOCAB tokens trained on sentences of `words`, as transformers wraps it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    sentences = (" ".join(rng.choice(words) for _ in range(rng.randint(8, 24))) for _ in range(20000))
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sentences, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=SPECIAL[0], bos_token=SPECIAL[1],
                                   eos_token=SPECIAL[2])


def unprintable_ids(tokenizer, vocab_size: int) -> list[int]:
    """The ids greedy decoding must not pick: those past the tokenizer's vocabulary, <unk> and <s>, and tokens that
    are not printable ASCII on their own (a lone byte of a UTF-8 character: a server streams nothing for it until
    the character completes, while decoding the whole text gives U+FFFD)."""
    def printable(i: int) -> bool:
        text = tokenizer.decode([i], skip_special_tokens=True)
        return bool(text) and all(" " <= c <= "~" for c in text)

    vocab = len(tokenizer)
    return [i for i in range(vocab) if i != EOS_ID and not printable(i)] + list(range(vocab, vocab_size))


def build_folder(folder: Path, small: bool) -> None:
    """Save the model, its generation config and the tokenizer to folder (see the module's docstring)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config

    tokenizer = train_tokenizer(make_words())
    config = GPT2Config(**(SMALL if small else {}), bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # tied: the head's rows too
        model.get_input_embeddings().weight[unprintable_ids(tokenizer, config.vocab_size)] = 0.0
    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
                     do_sample=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def ensure_folder(folder: Path, small: bool) -> str:
    """Build the folder unless it holds this build of the model already; a line saying which model it is."""
    stamp = {"builder": "benchmarks/serving.py", "version": FOLDER_VERSION, "small": small}
    stamp_file = folder / FOLDER_STAMP
    if not stamp_file.is_file() or json.loads(stamp_file.read_text()) != stamp:
        if (folder / "config.json").is_file() and not stamp_file.is_file():
            raise SystemExit(f"{folder} holds a model this benchmark did not build: pass another --model-folder")
        folder.mkdir(parents=True, exist_ok=True)
        build_folder(folder, small)
        stamp_file.write_text(json.dumps(stamp))
    config = json.loads((folder / "config.json").read_text())
    return (f"GPT-2 {config['n_layer']} layers, hidden {config['n_embd']}, vocabulary {config['vocab_size']} "
            f"(random weights), {folder}")


# ---- in-process baselines (virtual time) --------------------------------------------------------------------


class TokenClock:
    """A generate streamer noting when each new token comes (the first put is the prompt)."""

    def __init__(self):
        self.times_s: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times_s.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@torch.no_grad()
def run_hf_sequential(model, tokenizer, requests) -> list[Outcome]:
    """model.generate per request, greedy, up to max_tokens or eos (included), requests served in arrival order one
    at a time; times in virtual seconds from the first arrival."""
    outcomes, clock_s = [], 0.0
    for request in requests:
        start_s = max(clock_s, request.arrival_s)
        ids = torch.tensor([request.prompt_ids])
        streamer = TokenClock()
        began = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_tokens,
                             do_sample=False, pad_token_id=EOS_ID, streamer=streamer)
        clock_s = start_s + time.perf_counter() - began
        new = out[0, ids.shape[1]:].tolist()
        outcomes.append(Outcome(request.arrival_s, [start_s + t - began for t in streamer.times_s], len(new), True,
                                clock_s, tokenizer.decode(new, skip_special_tokens=True), new))
    return outcomes


def static_engine(model, folder: Path):
    """zplan's engine for the folder's model: the summary traced from the folder as `zplan compile` does."""
    from zplan.model_input import trace_model_file
    from zplan.runtime.inference.engine import InferenceEngine

    summary = trace_model_file(folder, MAX_SEQ_LEN, "fp32")[1]
    return InferenceEngine.from_model(model, summary, max_batch=STATIC_MAX_BATCH, max_seq_len=MAX_SEQ_LEN)


def run_static(engine, tokenizer, requests) -> list[Outcome]:
    """engine.stream over batches of up to STATIC_MAX_BATCH requests that have arrived when the previous batch
    ends (or the next request's arrival), each run to its end; virtual seconds from the first arrival."""
    from zplan.runtime.inference.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, stop_token=EOS_ID)
    outcomes: list[Outcome | None] = [None] * len(requests)
    clock_s, i = 0.0, 0
    while i < len(requests):
        start_s = max(clock_s, requests[i].arrival_s)
        batch = [r for r in requests[i:i + STATIC_MAX_BATCH] if r.arrival_s <= start_s]
        i += len(batch)
        tokens: list[list[int]] = [[] for _ in batch]
        times: list[list[float]] = [[] for _ in batch]
        failed = [False] * len(batch)
        began = time.perf_counter()
        for step in engine.stream([list(r.prompt_ids) for r in batch], [r.max_tokens for r in batch],
                                  [greedy] * len(batch)):
            now_s = start_s + time.perf_counter() - began
            for b, token in enumerate(step):
                if isinstance(token, int):
                    tokens[b].append(token)
                    times[b].append(now_s)
                elif token is not None:  # a SamplingFailure
                    failed[b] = True
        clock_s = start_s + time.perf_counter() - began
        for b, request in enumerate(batch):
            outcomes[request.index] = Outcome(request.arrival_s, times[b], len(tokens[b]), not failed[b], clock_s,
                                              tokenizer.decode(tokens[b], skip_special_tokens=True), tokens[b])
    return outcomes


def greedy_match(outcomes: list[Outcome], references: list[Outcome]) -> dict:
    """Fraction of the referenced requests whose text equals the reference's; the first mismatch, if any."""
    matches, first = 0, None
    for index, reference in enumerate(references):
        got = outcomes[index]
        if got.ok and got.text == reference.text:
            matches += 1
        elif first is None:
            first = {"request": index, "expected": reference.text[:120], "got": got.text[:120], "error": got.error}
    return {"fraction": round(matches / len(references), 4), "compared": len(references), "first_mismatch": first}


# ---- servers ------------------------------------------------------------------------------------------------


def server_env(pythonpath: str | None = None) -> dict[str, str]:
    """This process's environment with the venv's bin first on PATH; `pythonpath` put before PYTHONPATH."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
    return env


def _get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


class Server:
    """A server subprocess (its own session, output to log_path): healthy on start, SIGTERM on stop."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, env: dict[str, str]):
        self.name, self.argv, self.port, self.log_path, self.env = name, argv, port, log_path, env
        self.process: subprocess.Popen | None = None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def start(self, timeout_s: float) -> float:
        """Start the process and wait for GET /health 200; seconds it took. PartError if it exits or times out."""
        began = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        while time.perf_counter() - began < timeout_s:
            if self.process.poll() is not None:
                raise PartError(f"{self.name} exited with {self.process.returncode} before /health answered; "
                                f"its output ({self.log_path}):\n{self.log_tail()}")
            try:
                if _get(self.port, "/health")[0] == 200:
                    return time.perf_counter() - began
            except OSError:
                pass
            time.sleep(0.5)
        raise PartError(f"{self.name}: no /health 200 within {timeout_s:.0f} s; its output:\n{self.log_tail()}")

    def model_id(self, fallback: str) -> str:
        """The first model GET /v1/models lists, else fallback."""
        try:
            status, body = _get(self.port, "/v1/models", timeout_s=30)
            listed = json.loads(body).get("data") or [] if status == 200 else []
            return listed[0]["id"] if listed else fallback
        except (OSError, ValueError, KeyError, TypeError):
            return fallback

    def rss_bytes(self) -> int:
        """Resident memory of the server process and its children (bytes)."""
        import psutil

        process = psutil.Process(self.process.pid)
        total = 0
        for p in [process, *process.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then (after timeout_s) SIGKILL to the process group this server started; its exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()


@contextmanager
def running(server: Server, timeout_s: float):
    try:
        yield server.start(timeout_s)
    finally:
        server.stop()


def zplan_argv(folder: Path, port: int) -> list[str]:
    return [str(BIN / "zplan"), "serve", str(folder), "--port", str(port)]


def check_transformers_serve(env: dict[str, str]) -> None:
    """PartError when `transformers serve` cannot load a model on the CPU: it passes device_map, which needs the
    accelerate package."""
    done = subprocess.run([sys.executable, "-c", "import accelerate"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise PartError("`transformers serve` loads models with a device_map, which needs the accelerate package: "
                        "`pip install accelerate`, or install it into a folder of its own (pip install --no-deps "
                        "--target DIR accelerate) and pass --transformers-pythonpath DIR")


def transformers_cb_blocks(requests, soak_clients: int) -> int:
    """KV cache blocks (of CB_PAGE_TOKENS tokens) for transformers serve: every request of the workload at once (or
    one block per soak client), plus slack. Unbounded, it takes 60 % of the machine's free RAM on a CPU."""
    workload = sum(-(-(len(r.prompt_ids) + r.max_tokens) // CB_PAGE_TOKENS) for r in requests)
    return max(workload, soak_clients) + 16


def transformers_argv(folder: Path, port: int, cb_blocks: int) -> list[str]:
    return [str(BIN / "transformers"), "serve", "--continuous-batching", str(folder), "--host", HOST, "--port",
            str(port), "--device", "cpu", "--log-level", "warning", "--cb-num-blocks", str(cb_blocks)]


def warm_up(port: int, model: str, timeout_s: float) -> float:
    """One short completion before the measured runs (first-request set-up); its seconds."""
    result = asyncio.run(stream_completion(HOST, port, {"model": model, "prompt": "hello", "max_tokens": 4,
                                                        "temperature": 0, "stream": True}, timeout_s=timeout_s))
    if not result.finished(False):
        raise PartError(f"the warm-up request failed: {result.error}")
    return round(result.end_s - result.send_s, 2)


def serve_session(name: str, argv: list[str], port: int, env: dict[str, str], folder: Path, args, requests,
                  soak_prompts, *, workload: bool, soak_it: bool, require_done: bool, timings: dict
                  ) -> tuple[dict, list[Outcome], dict | None]:
    """Start the server, run the workload and/or the soak against it, stop it: (workload metrics, outcomes, soak)."""
    server = Server(name, argv, port, Path(args.log_dir) / f"{name}.log", env)
    progress(f"{name}: starting `{' '.join(argv)}` (output in {server.log_path})")
    began = time.perf_counter()
    result, outcomes, soaked = None, [], None
    with running(server, args.startup_timeout) as startup_s:
        progress(f"{name}: healthy after {startup_s:.0f} s; a warm-up request")
        model = server.model_id(fallback=folder.name)
        result = {"startup_s": round(startup_s, 1), "model_id": model,
                  "warmup_request_s": warm_up(port, model, args.request_timeout)}
        if workload:
            progress(f"{name}: {len(requests)} requests")
            outcomes, streams = asyncio.run(run_workload(HOST, port, model, requests, timeout_s=args.request_timeout))
            result.update(metrics(outcomes))
            result["streams_without_done"] = sum(s.done_markers == 0 for s in streams)
            result["usage_reported"] = sum(s.usage_tokens is not None for s in streams)
        if soak_it:
            progress(f"{name}: soak, {args.soak_clients} clients for {args.soak_seconds:.0f} s")
            soaked = asyncio.run(soak(HOST, port, model, soak_prompts, clients=args.soak_clients,
                                      seconds=args.soak_seconds,
                                      warmup_s=min(SOAK_WARMUP_S, args.soak_seconds / 2), rss_bytes=server.rss_bytes,
                                      require_done=require_done, timeout_s=args.request_timeout))
    result["exit_code"] = server.process.returncode
    result["log"] = str(server.log_path)
    timings[name] = round(time.perf_counter() - began, 1)
    return result, outcomes, soaked


# ---- main ---------------------------------------------------------------------------------------------------


def selected_parts(args) -> set[str]:
    if args.only:
        parts = {p.strip() for p in args.only.split(",") if p.strip()}
        unknown = parts - set(PARTS)
        if unknown:
            raise SystemExit(f"--only: unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
        return parts
    skipped = {p for p in PARTS if getattr(args, f"skip_{p}")}
    return set(PARTS) - skipped


def ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--small", action="store_true", help="a 2-layer, hidden-64 GPT-2 (try the harness)")
    parser.add_argument("--model-folder", type=Path, help="the model folder (built when missing)")
    parser.add_argument("--requests", type=int, help="default 64 (16 with --small)")
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-requests", type=int, default=None,
                        help="run generate on the first N requests only (default all; the greedy check covers those)")
    for part in PARTS:
        parser.add_argument(f"--skip-{part}", action="store_true")
    parser.add_argument("--only", help=f"comma-separated parts to run: {', '.join(PARTS)}")
    parser.add_argument("--soak-seconds", type=float, help="default 60 (10 with --small)")
    parser.add_argument("--soak-clients", type=int, default=200)
    parser.add_argument("--soak-server", choices=("zplan", "transformers"), default="zplan",
                        help="the server the soak runs against (transformers: to try the harness)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    parser.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take")
    parser.add_argument("--transformers-pythonpath",
                        help="a folder put first on PYTHONPATH for transformers serve only (one holding accelerate)")
    parser.add_argument("--log-dir", help="where the servers' output goes (default: a temporary folder)")
    return parser.parse_args()


def run_in_process(parts: set[str], folder: Path, tokenizer, requests, args, result: dict, timings: dict
                   ) -> list[Outcome] | None:
    """hf_sequential and static; the greedy references (generate's outcomes) or None."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    references = None
    if "hf" in parts:
        began = time.perf_counter()
        subset = requests[:args.hf_requests] if args.hf_requests else requests
        progress(f"hf_sequential: generate on {len(subset)} requests, one at a time")
        references = run_hf_sequential(model, tokenizer, subset)
        result["hf_sequential"] = metrics(references)
        timings["hf_sequential"] = round(time.perf_counter() - began, 1)
    if "static" in parts:
        began = time.perf_counter()
        progress("static: zplan's engine, batches of up to 16 requests run to their end")
        try:
            engine = static_engine(model, folder)
            outcomes = run_static(engine, tokenizer, requests)
            result["static"] = metrics(outcomes)
            if references:
                result["static"]["greedy_match"] = greedy_match(outcomes, references)
            engine.close()
        except Exception as error:  # reported as the part's error; the other parts still run
            result["static"] = {"error": f"{type(error).__name__}: {error}"}
        timings["static"] = round(time.perf_counter() - began, 1)
    del model
    gc.collect()
    return references


def run_servers(parts: set[str], folder: Path, requests, soak_prompts, references, args, result: dict,
                timings: dict) -> None:
    soak_on = "soak" in parts
    for name, key in (("zplan", "zplan"), ("transformers", "transformers_serve")):
        workload = name in parts
        soak_here = soak_on and args.soak_server == name
        if not (workload or soak_here):
            continue
        port = free_port()
        try:
            if name == "zplan":
                env = server_env()
                argv = zplan_argv(folder, port)
            else:
                env = server_env(args.transformers_pythonpath)
                check_transformers_serve(env)
                cb_blocks = transformers_cb_blocks(requests, args.soak_clients if soak_here else 0)
                argv = transformers_argv(folder, port, cb_blocks)
            metrics_, outcomes, soaked = serve_session(
                name, argv, port, env, folder, args, requests, soak_prompts, workload=workload, soak_it=soak_here,
                require_done=name == "zplan", timings=timings)
        except PartError as error:
            message = str(error)
            if name == "zplan" and "No such command 'serve'" in message:
                message = ("`zplan serve` is not available: this zplan has no serve command. Leave it out with "
                           "--skip-zplan --skip-soak.")
            metrics_, outcomes, soaked = {"error": message}, [], ({"error": message} if soak_here else None)
        if workload:
            if references and outcomes:
                metrics_["greedy_match"] = greedy_match(outcomes, references)
            result[key] = metrics_
            if name == "transformers" and "error" not in metrics_:
                metrics_["cb_num_blocks"] = cb_blocks
        if soaked is not None:
            result["soak"] = {"server": name, **soaked}


def main() -> None:
    args = parse_args()
    parts = selected_parts(args)
    if args.soak_seconds is None:
        args.soak_seconds = 10.0 if args.small else 60.0
    if args.requests is None:
        args.requests = 16 if args.small else 64
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(os.cpu_count() or 1)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="zplan-serving-logs-")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    folder = args.model_folder or Path(tempfile.gettempdir()) / "zplan-serving" / ("gpt2-small" if args.small
                                                                                   else "gpt2")
    timings: dict[str, float] = {}
    began = time.perf_counter()
    progress(f"model folder {folder.resolve()}")
    described = ensure_folder(folder.resolve(), args.small)
    folder = folder.resolve()
    timings["model_folder"] = round(time.perf_counter() - began, 1)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    words = make_words()
    requests = make_workload(tokenizer, words, n=args.requests, rate=args.rate, seed=args.seed)
    soak_prompts = [(r.prompt, r.max_tokens) for r in make_workload(
        tokenizer, words, n=256, rate=1.0, seed=args.seed + 1, prompt_tokens=(8, 32), output_tokens=(4, 16))]

    load_before = os.getloadavg()
    result: dict = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "transformers": __import__("transformers").__version__},
        "model": described, "parts": sorted(parts),
        "workload": {"requests": len(requests), "rate_per_s": args.rate, "seed": args.seed,
                     "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
                     "max_tokens": sum(r.max_tokens for r in requests),
                     "arrival_span_s": round(requests[-1].arrival_s, 2)}}
    references = None
    if parts & {"hf", "static"}:
        references = run_in_process(parts, folder, tokenizer, requests, args, result, timings)
    run_servers(parts, folder, requests, soak_prompts, references, args, result, timings)
    summarize(result, references)
    result["timings_s"] = timings
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    if not args.json:
        print_human(result)
    print(json.dumps(result))
    failed = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    sys.exit(1 if failed else 0)


def summarize(result: dict, references) -> None:
    """The headline ratios (null where a side did not run or failed)."""
    def get(key: str, metric: str):
        return (result.get(key) or {}).get(metric)

    zplan_tps = get("zplan", "throughput_tokens_per_s")
    result["throughput_over_transformers_serve"] = ratio(zplan_tps, get("transformers_serve",
                                                                        "throughput_tokens_per_s"))
    result["p99_ttft_over_transformers_serve"] = ratio(get("zplan", "ttft_p99_s"),
                                                       get("transformers_serve", "ttft_p99_s"))
    result["throughput_over_static"] = ratio(zplan_tps, get("static", "throughput_tokens_per_s"))
    result["throughput_over_hf_sequential"] = ratio(zplan_tps, get("hf_sequential", "throughput_tokens_per_s"))
    result["greedy_match_fraction"] = (get("zplan", "greedy_match") or {}).get("fraction")
    result["lost"] = get("soak", "lost")
    result["rss_growth_bytes"] = get("soak", "rss_growth_bytes")


def print_human(result: dict) -> None:
    print(f"{result['model']}; {result['workload']['requests']} requests at {result['workload']['rate_per_s']}/s; "
          f"{result['machine']['cpus']} CPUs, torch {result['machine']['torch']}")
    print(f"  {'run':<20}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'failed':>8}  greedy")
    for key in ("hf_sequential", "static", "zplan", "transformers_serve"):
        run = result.get(key)
        if run is None:
            continue
        if "error" in run:
            print(f"  {key:<20}error: {run['error'][:600]}")
            continue
        match = (run.get("greedy_match") or {}).get("fraction", "-")
        print(f"  {key:<20}{run['throughput_tokens_per_s']:>10}{run['ttft_p50_s']:>10}{run['ttft_p99_s']:>10}"
              f"{run['tpot_p50_s']:>10}{run['requests_failed']:>8}  {match}")
    if "soak" in result:
        print(f"  soak: {json.dumps(result['soak'])[:800]}")
    for key in ("throughput_over_transformers_serve", "p99_ttft_over_transformers_serve", "throughput_over_static",
                "throughput_over_hf_sequential", "greedy_match_fraction", "lost", "rss_growth_bytes"):
        print(f"  {key:<36}{result[key]}")
    print(f"  seconds per part: {result['timings_s']}")


if __name__ == "__main__":
    main()
