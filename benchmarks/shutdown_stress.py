"""Shutdown stress: consecutive 2-process runs of the emitted programs, counting the ones that fail at exit.

Four kinds, each launched through its emitted launch script (torchrun, gloo, 2 processes), as a user runs them:
  train-zero3      a tiny Hugging Face Phi-3 (built from its config: fused qkv and gate/up), ZeRO-3 dp 2, 3 steps
  train-tp2        examples/tiny.py, tensor parallel 2, 3 steps
  generate-tp2     examples/tiny.py's inference plan at tp 2, two prompts
  serve-tp2        the same plan's server: one POST /v1/completions, then SIGTERM to rank 0; every rank must
                   exit 0
A run fails when the launcher exits non-zero; it is an abort when a process died of SIGABRT or printed
"terminate called" (what the C++ runtime prints when it aborts). Prints one line per kind and, with --json,
{"runs": N, "kinds": {kind: {"runs", "failures", "aborts", "seconds"}}, "aborts": total}.

    .venv/bin/python benchmarks/shutdown_stress.py [--runs 50] [--kinds train-tp2,serve-tp2] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import TINY, free_port  # noqa: E402

BIN = Path(sys.executable).parent
KINDS = ("train-zero3", "train-tp2", "generate-tp2", "serve-tp2")

HF_PHI3 = '''"""A tiny Hugging Face Phi-3, built from its config (nothing is downloaded)."""
from transformers import AutoModelForCausalLM, Phi3Config

VOCAB_SIZE = 128
SEQ_LEN = 32


def build_model():
    config = Phi3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(config)
'''


def environment() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


def compile_plan(args: list[str], out: Path) -> Path:
    subprocess.run([str(BIN / "zplan"), "compile", *args, "--cluster", "cpu-local", "--precision", "fp32",
                    "-o", str(out)], check=True, capture_output=True, text=True, timeout=300)
    return out


def prepare(workdir: Path, kinds: list[str]) -> dict[str, Path]:
    """Compile the plan of each kind into workdir."""
    plans = {}
    if "train-zero3" in kinds:
        model = workdir / "hf_phi3.py"
        model.write_text(HF_PHI3)
        plans["train-zero3"] = compile_plan([str(model), "--gpus", "2", "--zero", "3", "--dp", "2",
                                             "--global-batch", "8", "--seq", "32"], workdir / "zero3")
    if "train-tp2" in kinds:
        plans["train-tp2"] = compile_plan([str(TINY), "--gpus", "2", "--tp", "2", "--global-batch", "4",
                                           "--seq", "32"], workdir / "tp2")
    if {"generate-tp2", "serve-tp2"} & set(kinds):
        plans["generate-tp2"] = plans["serve-tp2"] = compile_plan(
            [str(TINY), "--mode", "inference", "--gpus", "2", "--tp", "2", "--batch", "2", "--prompt-len", "16",
             "--gen-len", "4"], workdir / "serve")
    return plans


def run_train(plan: Path) -> tuple[int, str]:
    done = subprocess.run(["bash", str(plan / "launch" / "torchrun.sh"), "--steps", "3"], capture_output=True,
                          text=True, timeout=300, env=environment())
    return done.returncode, done.stdout + done.stderr


def run_generate(plan: Path) -> tuple[int, str]:
    done = subprocess.run(["bash", str(plan / "launch" / "generate.sh"), "--max-new-tokens", "4"],
                          input="The plan is\nabc\n", capture_output=True, text=True, timeout=300,
                          env=environment())
    return done.returncode, done.stdout + done.stderr


def _healthy(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False


def _rank_zero_child(parent: int) -> int | None:
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        if b"RANK=0" in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    return None


def run_serve(plan: Path) -> tuple[int, str]:
    """Start the tp 2 server, wait for /health, answer one greedy completion of 4 tokens (both ranks run its engine
    steps), SIGTERM rank 0 (as an orchestrator stopping the replica's front process does); torchrun must then exit
    0."""
    port = free_port()
    launcher = subprocess.Popen(["bash", str(plan / "launch" / "serve.sh")], env={**environment(), "PORT": str(port)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(port):
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.2)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                           body=json.dumps({"prompt": "abc", "max_tokens": 4, "temperature": 0}))
        response = connection.getresponse()
        status, body = response.status, response.read()
        try:  # examples/tiny.py has no end-of-text token: the completion runs to its 4 tokens
            completed = status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
        except (ValueError, KeyError, TypeError):  # not a completion's JSON
            completed = False
        rank0 = _rank_zero_child(launcher.pid)
        if not completed or rank0 is None:
            raise RuntimeError(f"request answered {status} {body[:300]!r}; rank 0 pid {rank0}")
        os.kill(rank0, signal.SIGTERM)
        output, _ = launcher.communicate(timeout=120)
        return launcher.returncode, output
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        os.killpg(launcher.pid, signal.SIGKILL)
        output, _ = launcher.communicate()
        return 1, f"{output}\n{error}"


RUNNERS = {"train-zero3": run_train, "train-tp2": run_train, "generate-tp2": run_generate, "serve-tp2": run_serve}


def is_abort(returncode: int, output: str) -> bool:
    return returncode == -signal.SIGABRT or "terminate called" in output or "SIGABRT" in output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each kind (default 50)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    parser.add_argument("--keep-failures", metavar="DIR", help="write each failed run's output to DIR")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="zplan-shutdown-") as tmp:
        plans = prepare(Path(tmp), kinds)
        for kind in kinds:
            failures = aborts = 0
            start = time.monotonic()
            for run in range(1, args.runs + 1):
                returncode, output = RUNNERS[kind](plans[kind])
                if returncode != 0:
                    failures += 1
                    aborts += is_abort(returncode, output)
                    if args.keep_failures:
                        Path(args.keep_failures).mkdir(parents=True, exist_ok=True)
                        (Path(args.keep_failures) / f"{kind}-{run}.log").write_text(output)
            seconds = time.monotonic() - start
            results[kind] = {"runs": args.runs, "failures": failures, "aborts": aborts, "seconds": round(seconds, 1)}
            print(f"{kind:13s} {args.runs} runs: {failures} failed, {aborts} aborted ({seconds:.0f} s)",
                  file=sys.stderr, flush=True)
    total = sum(r["aborts"] for r in results.values())
    if args.json:
        print(json.dumps({"runs": args.runs, "kinds": results, "aborts": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
