"""zplan's inference engine serving Hugging Face causal LMs, against transformers as the reference.

Each tiny model is built from its config as a user would (AutoModelForCausalLM.from_config with an explicit
attention implementation, weights moved off the init), saved with save_pretrained beside a tokenizer trained here,
and compiled in this process with `zplan compile FOLDER --mode inference --gpus 1 --cluster cpu-local` (once per
family). The engine the runtime builds from that plan and `--weights FOLDER` must give transformers' forward logits
(fp32, within 1e-5) and model.generate(do_sample=False)'s greedy tokens; for the Llama, the emitted generate.py and
the HTTP server too. The families cover q/k/v biases (Qwen2), per-head q/k norms (Qwen3), sliding windows shorter
than the text (Mistral, Gemma-2), Gemma-2's 1 + weight norms, sandwich norms, GeGLU, scaled embeddings and soft-
capped scores and logits (eager), fused qkv / gate_up Linears with partial RoPE (Phi-3), and Conv1D with learned
positions (GPT-2).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from tests.unit.test_export_hf import VOCAB, save_tokenizer  # noqa: E402  (byte-level BPE, 3 special tokens)
from zplan.cli import app  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the tokenizer's <unk>, <s>, </s>
WINDOW = 5  # sliding window (tokens), shorter than prompt + generated text
FAMILIES = {  # name -> (config, attention implementation)
    "llama": (lambda: transformers.LlamaConfig(**SIZES, **SPECIAL), "sdpa"),
    "qwen2": (lambda: transformers.Qwen2Config(**SIZES, **SPECIAL), "eager"),
    "qwen3": (lambda: transformers.Qwen3Config(**SIZES, **SPECIAL, head_dim=8), "sdpa"),
    "mistral": (lambda: transformers.MistralConfig(**SIZES, **SPECIAL, sliding_window=WINDOW), "sdpa"),
    "gemma2": (lambda: transformers.Gemma2Config(**SIZES, **SPECIAL, head_dim=8, sliding_window=WINDOW,
                                                 query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                                 final_logit_softcapping=3.0), "eager"),
    "phi3": (lambda: transformers.Phi3Config(**SIZES, **SPECIAL, partial_rotary_factor=0.5), "eager"),
    # GPT-2 without a pad_token_id: with one, tracing the folder on the meta device fails (transformers'
    # warn_if_padding_and_no_attention_mask reads the ids; see the report of this test's change)
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                             bos_token_id=1, eos_token_id=2), "eager"),
}
PROMPTS = ["hello world, hello plan", "the plan"]  # different lengths: the engine's batch is right-padded
NEW_TOKENS = 12
MAX_BATCH = 2


def save_folder(folder: Path, name: str) -> Path:
    """The family's tiny model, its weights moved off the init (norm weights included), saved with a tokenizer."""
    config, attention = FAMILIES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation=attention)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def compile_inference(model: Path, out: Path):
    """`zplan compile MODEL --mode inference --gpus 1 --cluster cpu-local ... -o OUT` in this process."""
    return CliRunner().invoke(app, ["compile", str(model), "--mode", "inference", "--gpus", "1", "--cluster",
                                    "cpu-local", "--precision", "fp32", "--batch", str(MAX_BATCH), "--prompt-len",
                                    "24", "--gen-len", str(NEW_TOKENS), "-o", str(out)])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """name -> (folder, plan folder): each family saved and compiled once, when a test first asks for it."""
    done: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in done:
            root = tmp_path_factory.mktemp(name)
            folder = save_folder(root / name, name)
            result = compile_inference(folder, root / "plan")
            assert result.exit_code == 0, result.output
            done[name] = folder, root / "plan"
        return done[name]

    return get


def reference(folder: Path, name: str):
    """transformers' model of the folder, with the family's attention implementation, fp32."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=FAMILIES[name][1],
                                                             dtype=torch.float32).eval()


def greedy(model, ids: list[int], eos: int) -> list[int]:
    """model.generate's greedy new tokens, up to and including its first eos (it pads after it)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(ids):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out


class Engine:
    """engine_from_plan(plan, FOLDER, weights=FOLDER) in a process group of one, as generate.py builds it."""

    def __init__(self, folder: Path, out: Path):
        from zplan.runtime.inference.build import engine_from_plan, load_inference_plan

        self.engine, self.tokenizer, self.ctx = engine_from_plan(load_inference_plan(out / "plan.json"), folder,
                                                                 weights=folder)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        from zplan.runtime.launch.distributed import close_distributed

        self.engine.close()
        close_distributed(clean=True)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_and_greedy_tokens_equal_transformers(compiled, name):
    from zplan.runtime.inference.sampling import SamplingParams

    folder, out = compiled(name)
    hf = reference(folder, name)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt_ids = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))  # (B, T), T > WINDOW
    with Engine(folder, out) as run:
        logits = run.engine.forward_logits(ids)  # (B, T, V) fp32
        engine_ids = [run.tokenizer.encode(p) for p in PROMPTS]  # the folder's own tokenizer
        tokens = run.engine.generate(engine_ids, NEW_TOKENS, SamplingParams(stop_token=run.tokenizer.eos_id))
        paged = continuous_batching(run.engine, engine_ids, SamplingParams(stop_token=run.tokenizer.eos_id))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    assert expected.abs().max() > 1.0  # logits far from zero: a wrong part would show
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert engine_ids == prompt_ids
    assert run.tokenizer.eos_id == SPECIAL["eos_token_id"]
    assert tokens == [greedy(hf, p, SPECIAL["eos_token_id"]) for p in prompt_ids]
    assert paged == tokens
    assert max(len(t) for t in tokens) + len(prompt_ids[0]) > WINDOW


def continuous_batching(engine, prompts: list[list[int]], sampling) -> list[list[int]]:
    """The serving path's tokens: the scheduler over a paged cache, prompts read in chunks of 5 tokens (shorter
    than the prompts, so a chunk attends to cached keys, through the sliding windows too)."""
    from tests.unit.test_continuous_batching import run
    from zplan.runtime.inference.scheduler import Scheduler, Sequence, blocks_for

    scheduler = Scheduler(engine, 2 * blocks_for(engine.max_seq_len), max_running=2, max_step_tokens=5)
    return run(scheduler, [Sequence(p, NEW_TOKENS, sampling) for p in prompts])


def test_generate_py_of_a_folder_equals_transformers(compiled):
    """The emitted generate.py with --weights FOLDER (a subprocess, as a user runs it)."""
    folder, out = compiled("llama")
    result = subprocess.run([sys.executable, str(out / "generate.py"), "--tokens", "--weights", str(folder),
                             "--max-new-tokens", str(NEW_TOKENS)], input="\n".join(PROMPTS) + "\n",
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, result.stderr[-3000:]
    got = [[int(t) for t in line.split()] for line in result.stdout.splitlines()]
    hf = reference(folder, "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert got == [greedy(hf, tokenizer(p)["input_ids"], SPECIAL["eos_token_id"]) for p in PROMPTS]


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_zplan_serve_answers_as_transformers(compiled, tmp_path):
    """`zplan serve FOLDER` as a user runs it (a subprocess; it plans for this machine, then serves): greedy
    completions equal transformers' generate, a prompt longer in characters than the KV cache in tokens is served,
    and SIGTERM stops it cleanly."""
    folder, _ = compiled("llama")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "zplan", "serve", str(folder), "--port", str(port), "--plan",
                               str(tmp_path / "plan")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "zplan serve did not start"
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        long_prompt = " ".join([PROMPTS[0]] * 3)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("GET", "/v1/models")
        context = json.loads(connection.getresponse().read())["data"][0]["max_model_len"]
        answers = [post(port, "/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})
                   for prompt in (*PROMPTS, long_prompt)]
    finally:
        server.terminate()
        output = server.communicate(timeout=60)[0]
    assert server.returncode == 0, output[-3000:]
    assert "planned for 1 x cpu-local" in output
    hf = reference(folder, "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for (status, answer), prompt in zip(answers, (*PROMPTS, long_prompt), strict=True):
        assert status == 200, answer
        expected = greedy(hf, tokenizer(prompt)["input_ids"], SPECIAL["eos_token_id"])
        assert answer["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert answer["usage"]["completion_tokens"] == len(expected)
    assert len(long_prompt) > context  # more characters than the context holds tokens
