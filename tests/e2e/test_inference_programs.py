"""End to end: `zplan compile examples/tiny.py --mode inference`, then the emitted programs with the real engine.

generate.py reads prompts on stdin and its greedy tokens must equal engine.generate run in this process on the
same seeded model; bad input ends with status 2 and a one-line message. serve.py (the OpenAI-compatible server)
runs as a subprocess on a loopback port under a bounded load (24 greedy POST /v1/completions, 6 at a time, a third
of them streaming, plus malformed ones): every good request gets generate.py's tokens for its prompt (its text is
the tokenizer's decode of them, and `logprobs` names them token by token), the malformed ones 400 in OpenAI's
error shape, the retired POST /v1/generate 404; the server stays up and stops on SIGTERM with status 0.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROMPTS = ["The plan is", "Hello, world", "zplan compiles models", "a", "1 2 3 4 5", "tensor parallel"]
NEW_TOKENS = 8
MAX_BATCH = 4


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inference") / "plan"
    subprocess.run([str(BIN / "zplan"), "compile", str(ROOT / "examples" / "tiny.py"), "--mode", "inference",
                    "--gpus", "1", "--cluster", "cpu-local", "--precision", "fp32", "--batch", str(MAX_BATCH),
                    "--prompt-len", "48", "--gen-len", str(NEW_TOKENS), "-o", str(out)],
                   capture_output=True, text=True, check=True, timeout=120)
    return out


def reference_tokens(plan_dir: Path, prompts: list[str], weights: dict | None = None) -> list[list[int]]:
    """Greedy tokens of engine.generate in this process, on `torch.manual_seed(0); build_model()`."""
    from zplan.model.model_file import load_model_file
    from zplan.runtime.inference.build import load_inference_plan
    from zplan.runtime.inference.engine import InferenceEngine
    from zplan.runtime.inference.sampling import SamplingParams
    from zplan.runtime.inference.tokenizer import ByteTokenizer
    from zplan.runtime.training.materialize import build_model

    plan = load_inference_plan(plan_dir / "plan.json")
    model = build_model(load_model_file(ROOT / "examples" / "tiny.py").build_model, 0, "cpu")
    if weights is not None:
        model.load_state_dict(weights)
    engine = InferenceEngine.from_model(model, plan.model, max_batch=plan.parallel.max_batch,
                                        max_seq_len=plan.parallel.max_seq_len)
    tokenizer = ByteTokenizer(engine.vocab_size)
    return [engine.generate([tokenizer.encode(p)], NEW_TOKENS, SamplingParams())[0] for p in prompts]


def generated_tokens(stdout: str) -> list[list[int]]:
    return [[int(t) for t in line.split()] for line in stdout.splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: bytes, path: str = "/v1/completions") -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, data


def get(port: int, path: str) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request("GET", path)
    response = connection.getresponse()
    status, body = response.status, json.loads(response.read())
    connection.close()
    return status, body


def as_answer(tokens: list[int]) -> dict:
    """What /v1/completions answers for the greedy `tokens` (the byte tokenizer of examples/tiny.py, vocabulary 256:
    no end-of-text id, so every request runs to max_tokens): the text, each token's text, the finish, the count."""
    from zplan.runtime.inference.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer(256)
    return {"text": tokenizer.decode(tokens), "tokens": [tokenizer.decode([t]) for t in tokens],
            "finish_reason": "length", "completion_tokens": len(tokens)}


def ask(port: int, prompt: str, stream: bool) -> dict:
    """as_answer's dict of a greedy completion of `prompt` (streamed: its events put together)."""
    fields = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 1, "stream": stream}
    if stream:
        fields["stream_options"] = {"include_usage": True}
    status, data = post(port, json.dumps(fields).encode())
    assert status == 200, data
    if not stream:
        body = json.loads(data)
        choice = body["choices"][0]
        assert body["object"] == "text_completion" and len(body["choices"]) == 1
        assert body["usage"]["prompt_tokens"] == len(prompt.encode())
        return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
                "finish_reason": choice["finish_reason"], "completion_tokens": body["usage"]["completion_tokens"]}
    blocks = [block for block in data.decode().split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks) and blocks[-1] == "data: [DONE]", blocks
    *pieces, finish, usage = [json.loads(block[len("data: "):]) for block in blocks[:-1]]
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in pieces) and usage["choices"] == []
    assert usage["usage"]["prompt_tokens"] == len(prompt.encode())
    return {"text": "".join(chunk["choices"][0]["text"] for chunk in pieces),
            "tokens": [t for chunk in pieces if chunk["choices"][0]["logprobs"]
                       for t in chunk["choices"][0]["logprobs"]["tokens"]],
            "finish_reason": finish["choices"][0]["finish_reason"],
            "completion_tokens": usage["usage"]["completion_tokens"]}


def assert_400(status: int, data: bytes, param: str | None) -> None:
    assert status == 400, data
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def wait_for_health(port: int, process: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.communicate()[1][-3000:]
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def rank_zero_child(parent: int) -> int:
    """The pid of the torchrun worker with RANK=0 (from /proc)."""
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if b"RANK=0" in environ:
            return int(child)
    raise AssertionError("no rank 0 worker")


@pytest.mark.slow
def test_generate_and_serve(compiled):
    """generate.py equals the engine in this process; serve.py under load equals generate.py."""
    plan = json.loads((compiled / "plan.json").read_text())
    assert plan["mode"] == "inference" and plan["parallel"]["max_batch"] == MAX_BATCH
    max_seq_len = plan["parallel"]["max_seq_len"]
    port = free_port()
    server = subprocess.Popen([sys.executable, str(compiled / "serve.py"), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")  # launch/generate.sh runs `python`
        generated = subprocess.run(["bash", str(compiled / "launch" / "generate.sh"), "--tokens", "--max-new-tokens",
                                    str(NEW_TOKENS)], input="\n".join(PROMPTS) + "\n\n", capture_output=True,
                                   text=True, timeout=120, env=env)
        assert generated.returncode == 0, generated.stderr
        by_generate = generated_tokens(generated.stdout)  # 6 prompts in batches of 4 and 2
        assert by_generate == reference_tokens(compiled, PROMPTS)  # each prompt alone
        assert "random initialisation" in generated.stderr  # no --weights: the warning that the text is noise
        expected = dict(zip(PROMPTS, by_generate, strict=True))

        wait_for_health(port, server)
        status, models = get(port, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]  # the model file's name
        assert models["data"][0]["max_model_len"] == max_seq_len
        jobs = [(PROMPTS[i % len(PROMPTS)], i % 3 == 0) for i in range(24)]
        too_long = json.dumps({"prompt": "x" * (max_seq_len - NEW_TOKENS + 1), "max_tokens": NEW_TOKENS})
        malformed = [(b'{"prompt": "no end', None), (b'{"prompt": "a", "n": 2}', "n"), (b'{"prompt": ""}', "prompt"),
                     (b'{"prompt": "a", "max_tokens": 2.5}', "max_tokens"),
                     (b'{"prompt": "a", "max_new_tokens": 2}', "max_new_tokens"),  # the retired API's field
                     (too_long.encode(), "prompt")]  # fits the field's bounds, not max_seq_len with max_tokens
        with ThreadPoolExecutor(max_workers=6) as pool:
            answers = list(pool.map(lambda job: ask(port, *job), jobs))
            bad = list(pool.map(lambda job: post(port, job[0]), malformed))
        assert answers == [as_answer(expected[prompt]) for prompt, _ in jobs]
        for (status, data), (_, param) in zip(bad, malformed, strict=True):
            assert_400(status, data, param)
        assert json.loads(bad[-1][1])["error"]["code"] == "context_length_exceeded"
        status, data = post(port, json.dumps({"prompt": "a", "max_new_tokens": 2}).encode(), "/v1/generate")
        assert status == 404 and json.loads(data)["error"]["type"] == "invalid_request_error", data
        status, health = get(port, "/health")
        assert status == 200 and health["status"] == "ok" and health["running"] == health["waiting"] == 0

        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
        assert server.returncode == 0, stderr
        assert "server stopped" in stderr
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_engine_from_plan_loads_a_weights_file(compiled, tmp_path, suffix):
    """train.py --save-weights' torch.save file, and a safetensors file (as `zplan export` writes, a tied weight
    under each of its names)."""
    from zplan.model.model_file import load_model_file
    from zplan.runtime.inference.build import engine_from_plan, load_inference_plan
    from zplan.runtime.inference.sampling import SamplingParams
    from zplan.runtime.launch.distributed import close_distributed
    from zplan.runtime.training.materialize import build_model

    model = build_model(load_model_file(ROOT / "examples" / "tiny.py").build_model, 0, "cpu")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # "trained": weights far from the init, whose greedy text is one repeated byte
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    trained = model.state_dict()
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pt":
        torch.save(trained, path)
    else:
        save_file = pytest.importorskip("safetensors.torch").save_file
        save_file({name: tensor.clone() for name, tensor in trained.items()}, str(path))
    plan = load_inference_plan(compiled / "plan.json")
    try:
        engine, tokenizer, ctx = engine_from_plan(plan, ROOT / "examples" / "tiny.py", weights=path)
        tokens = engine.generate([tokenizer.encode(PROMPTS[0])], NEW_TOKENS, SamplingParams())
    finally:
        close_distributed(clean=True)
    assert ctx.world_size == 1
    assert tokens == reference_tokens(compiled, PROMPTS[:1], trained)
    assert tokens != reference_tokens(compiled, PROMPTS[:1])  # other weights than the seed-0 init


@pytest.mark.slow
@pytest.mark.parametrize("stdin, args, message", [
    ("\n\n", [], "no prompts in standard input"),
    ("x" * 60 + "\n", [], "prompt 1 has 60 tokens"),
    ("ok\n", ["--batch", "9"], "--batch 9"),
    ("ok\n", ["--top-p", "0"], "0 < top-p <= 1"),
])
def test_generate_refuses_bad_input_with_one_line(compiled, monkeypatch, capsys, stdin, args, message):
    import io

    from zplan.runtime.inference.build import EngineSettings, load_inference_plan
    from zplan.runtime.inference.cli import generate_main

    settings = EngineSettings.from_plan(load_inference_plan(compiled / "plan.json"))
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    status = generate_main(compiled / "plan.json", ROOT / "examples" / "tiny.py", settings, NEW_TOKENS, args)
    error = capsys.readouterr().err
    assert status == 2 and message in error and error.startswith("zplan: error: ")


@pytest.mark.slow
def test_a_plan_for_another_model_file_or_world_size_is_refused(compiled, tmp_path):
    from zplan.errors import PlanMismatchError
    from zplan.runtime.inference.build import check_inference_plan, load_inference_plan

    plan = load_inference_plan(compiled / "plan.json")
    edited = tmp_path / "tiny.py"
    edited.write_text((ROOT / "examples" / "tiny.py").read_text() + "\n# edited\n")
    check_inference_plan(plan, ROOT / "examples" / "tiny.py", world_size=1, tp=1)  # the plan's own run passes
    with pytest.raises(PlanMismatchError, match="model file edited since the plan was made"):
        check_inference_plan(plan, edited, world_size=1, tp=1)
    with pytest.raises(PlanMismatchError, match="this run has 2 process"):
        check_inference_plan(plan, ROOT / "examples" / "tiny.py", world_size=2, tp=1)
    training_plan = tmp_path / "training.json"
    training_plan.write_text(json.dumps({"schema_version": 1, "parallel": {"tp": 1}}))
    with pytest.raises(PlanMismatchError, match="is a training plan"):
        load_inference_plan(training_plan)


@pytest.mark.slow
def test_scripts_are_deterministic_and_a_family_plan_exits_with_a_message(compiled, tmp_path, capsys):
    from zplan.codegen.inference_script import render_inference_scripts
    from zplan.runtime.inference.build import EngineSettings, load_inference_plan
    from zplan.runtime.inference.cli import generate_main

    plan = load_inference_plan(compiled / "plan.json")
    for name in ("a", "b"):
        render_inference_scripts(plan, tmp_path / name, "../tiny.py")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert [str(f) for f in files] == ["generate.py", "launch/generate.sh", "launch/serve.sh", "serve.py"]
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)

    family = plan.model_copy(update={"model": plan.model.model_copy(update={"source": "family"})})
    (tmp_path / "family").mkdir()
    (tmp_path / "family" / "plan.json").write_text(family.model_dump_json())
    render_inference_scripts(family, tmp_path / "family", None)
    assert "MODEL_FILE = None" in (tmp_path / "family" / "serve.py").read_text()
    status = generate_main(tmp_path / "family" / "plan.json", None, EngineSettings.from_plan(family), NEW_TOKENS, [])
    assert status == 2 and "family specs are for planning only" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds torchrun's workers through /proc")
def test_tensor_parallel_server_and_its_shutdown(compiled, tmp_path):
    """launch/serve.sh of a tp=2 replica: rank 0 serves, rank 1 follows its engine steps; SIGTERM to rank 0 stops
    both (torchrun then exits 0: every worker exited cleanly)."""
    from zplan.codegen.inference_script import render_inference_scripts
    from zplan.runtime.inference.build import load_inference_plan

    plan = load_inference_plan(compiled / "plan.json")
    tp2 = plan.model_copy(update={"parallel": plan.parallel.model_copy(update={"tp": 2}),
                                  "fingerprint": plan.fingerprint.model_copy(update={"world_size": 2})})
    out = tmp_path / "tp2"
    out.mkdir()
    (out / "plan.json").write_text(tp2.model_dump_json())
    render_inference_scripts(tp2, out, str(ROOT / "examples" / "tiny.py"))
    port = free_port()
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PORT=str(port))
    launcher = subprocess.Popen(["bash", str(out / "launch" / "serve.sh")], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        expected = dict(zip(PROMPTS, reference_tokens(compiled, PROMPTS), strict=True))
        wait_for_health(port, launcher)
        assert get(port, "/health")[1]["tp"] == 2
        jobs = [(prompt, i % 2 == 0) for i, prompt in enumerate(PROMPTS)]
        with ThreadPoolExecutor(max_workers=6) as pool:
            answers = list(pool.map(lambda job: ask(port, *job), jobs))
        assert answers == [as_answer(expected[prompt]) for prompt, _ in jobs]
        os.kill(rank_zero_child(launcher.pid), signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, stderr[-3000:]
        assert "server stopped" in stderr and "lost rank 0" not in stderr
    finally:
        if launcher.poll() is None:  # torchrun and its workers: the session started for them
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
