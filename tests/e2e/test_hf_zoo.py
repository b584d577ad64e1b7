"""Every plan that compiles runs, for Hugging Face models nobody on the team wrote.

Eleven tiny models built from their configs (tests/hf_zoo.py: Llama, Qwen2, Mistral, Gemma-2, Phi-3, Mixtral,
GPT-2 set up as training scripts set them up, use_cache=False and an explicit attention; BERT, T5, ViT with the
model's own loss from the batch's labels; a Llama from a saved config.json with its own example_inputs, train_data
and loss_fn) are compiled for 2 cpu-local processes unpinned and with --tp 2, --pp 2 and --zero 3
--dp 2. A compile either succeeds, and the emitted train.py then trains 2 steps on 2 processes, or refuses
with a SpecError that names what the runtime cannot run on the model (schemas/capability.py). What is
refused today is listed in REFUSED, so that a refusal appearing or going away is seen here too.
"""

from pathlib import Path

import pytest

from tests.distributed.harness import Ranks
from tests.hf_zoo import model_sources, save_llama_config
from zplan.errors import SpecError
from zplan.schemas import Pins
from zplan.schemas.capability import RULES

pytest.importorskip("transformers")

PINS = {"unpinned": Pins(), "tp2": Pins(tp=2), "pp2": Pins(pp=2), "zero3": Pins(zero=3, dp=2)}
DECODERS = ("llama", "qwen2", "mistral", "gemma2", "phi3", "mixtral", "gpt2")
# (model, pin) -> the trait kind behind the refusal (the runtime does not run it on such a model yet)
REFUSED = {
    ("t5", "pp2"): "several_block_stacks",
    ("bert", "tp2"): "parameters_beside_split_linears",
    ("t5", "tp2"): "parameters_beside_split_linears",
}


def compile_zoo_plan(model: Path, pins: Pins, out: Path) -> None:
    """`zplan compile MODEL --gpus 2 --cluster cpu-local --global-batch 8 --seq 32 --precision fp32 PINS -o OUT`,
    in this process (transformers is imported once)."""
    from zplan.api import compile_plan, prepare, write_outputs

    write_outputs(compile_plan(prepare(str(model), 2, "cpu-local", 8, 32, "fp32", pins)), out, str(model))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(model_sources()))
def test_each_compiled_plan_trains_and_each_refusal_names_the_reason(tmp_path, name):
    model = tmp_path / f"hf_{name}.py"
    model.write_text(model_sources()[name])
    save_llama_config(tmp_path)
    refused = {}
    for pin_name, pins in PINS.items():
        out = tmp_path / pin_name
        try:
            compile_zoo_plan(model, pins, out)
        except SpecError as error:
            refused[pin_name] = str(error)
            continue
        Ranks([str(out / "train.py"), "--steps", "2"], 2, out / "logs").wait_ok()
    expected = {pin for (model_name, pin) in REFUSED if model_name == name}
    assert set(refused) == expected, refused
    for pin_name, message in refused.items():  # the pin, the reason of the expected trait, the fix
        assert message.startswith(f"--{pin_name[:2]}: the runtime cannot run"), message
        assert RULES[REFUSED[name, pin_name]].why in message and f"use --{pin_name[:2]} 1" in message, message
