"""Loading model files: the contract, its defaults, and a helpful ModelLoadError for each bad file."""

import hashlib
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zplan.examples
from zplan.errors import ModelLoadError
from zplan.model.model_file import load_model_file, logits_of, next_token_loss

EXAMPLES = Path(zplan.examples.__file__).parent

GOOD_MODEL = """
import torch
from torch import nn

def build_model(width=8):
    return nn.Sequential(nn.Embedding(32, width), nn.Linear(width, 32))
"""


def write(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_tiny_example_loads_with_its_constants_and_hooks():
    model_file = load_model_file(EXAMPLES / "tiny.py")
    assert model_file.sha256 == hashlib.sha256((EXAMPLES / "tiny.py").read_bytes()).hexdigest()
    assert (model_file.seq_len, model_file.vocab_size, model_file.name) == (64, 256, "tiny")
    model = model_file.build()
    assert sum(p.numel() for p in model.parameters()) > 0
    batch = next(model_file.train_data(4, 16))
    assert batch.shape == (4, 16) and batch.dtype == torch.long
    # tiny.py's own train_data: arithmetic sequences, so every row has a constant step modulo V
    steps = (batch[:, 1:] - batch[:, :-1]) % 256
    assert (steps == steps[:, :1]).all()
    loss = model_file.loss_fn(model(batch), batch)
    assert loss.ndim == 0 and 4.0 < loss.item() < 7.0  # about log(256) = 5.5 at initialisation


def test_defaults_fill_missing_hooks(tmp_path):
    model_file = load_model_file(write(tmp_path, GOOD_MODEL))
    assert model_file.seq_len is None and model_file.vocab_size is None
    inputs = model_file.example_inputs(2, 5)
    assert inputs.shape == (2, 5) and inputs.dtype == torch.long
    with pytest.raises(ModelLoadError, match="VOCAB_SIZE"):
        model_file.train_data(2, 5)
    model = model_file.build(width=4)  # the keyword reaches build_model
    assert model[1].in_features == 4
    assert model_file.vocab_size == 32  # found in the built model's nn.Embedding
    batch = next(model_file.train_data(3, 7, seed=1))
    assert batch.shape == (3, 7) and 0 <= batch.min() and batch.max() < 32
    assert torch.equal(batch, next(model_file.train_data(3, 7, seed=1)))  # seeded


def test_sizes_passed_to_build_model_override_vocab_size():
    model_file = load_model_file(EXAMPLES / "gpt.py")
    assert model_file.vocab_size == 51200
    model_file.build("meta", num_layers=1, hidden=32, heads=2, vocab_size=300, max_seq_len=16)
    assert model_file.vocab_size == 300  # synthetic tokens must stay inside the built model's table


def test_default_loss_is_next_token_cross_entropy():
    torch.manual_seed(0)
    logits, tokens = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, 11), tokens[:, 1:].reshape(-1))
    assert torch.allclose(next_token_loss(logits, tokens), by_hand)
    assert torch.allclose(next_token_loss((logits,), {"input_ids": tokens}), by_hand)

    class HuggingFaceLike:
        def __init__(self, logits):
            self.logits = logits

    assert logits_of(HuggingFaceLike(logits)) is logits


def test_build_on_meta_allocates_nothing_and_skips_initialisation(tmp_path):
    path = write(tmp_path, """
        import torch
        from torch import nn

        def build_model():
            model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 16))
            nn.init.trunc_normal_(model[1].weight, std=0.02)
            model[0].weight.requires_grad_(False)  # frozen: must survive the skipped initialisation
            return model
    """)
    model = load_model_file(path).build(device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model[0].weight.requires_grad is False and model[1].weight.requires_grad is True


def test_same_file_twice_gives_independent_modules_and_sibling_imports_work(tmp_path):
    write(tmp_path, "WIDTH = 8\n", name="sizes.py")
    path = write(tmp_path, """
        from torch import nn
        import sizes

        CALLS = []

        def build_model():
            CALLS.append(1)
            return nn.Linear(sizes.WIDTH, sizes.WIDTH)
    """)
    first, second = load_model_file(path), load_model_file(path)
    first.build()
    assert first.module is not second.module and first.module.__name__ != second.module.__name__
    assert (len(first.module.CALLS), len(second.module.CALLS)) == (1, 0)


BAD_FILES = {
    "syntax error": ("def build_model(:\n    pass\n", ["SyntaxError", "line 1"]),
    "import raises": ("import torch\n\nraise RuntimeError('no GPU here')\n",
                      ["importing", "RuntimeError: no GPU here", "line 3", "Fix the file"]),
    "missing import": ("import not_a_real_package_xyz\n", ["ModuleNotFoundError", "not_a_real_package_xyz"]),
    "no build_model": ("def make_model():\n    pass\n",
                       ["no build_model()", "it defines: make_model", "def build_model()"]),
    "hook not callable": (GOOD_MODEL + "loss_fn = 3\n", ["loss_fn is a int", "def loss_fn"]),
    "bad constant": (GOOD_MODEL + "SEQ_LEN = 'long'\n", ["SEQ_LEN", "positive int"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_model_file_raises_a_helpful_error(tmp_path, case):
    source, expected = BAD_FILES[case]
    with pytest.raises(ModelLoadError) as caught:
        load_model_file(write(tmp_path, source))
    for text in expected:
        assert text in str(caught.value), (text, str(caught.value))


BAD_BUILDS = {
    "returns a non-Module": ("def build_model():\n    return {'layers': 2}\n",
                             ["returned dict", "not a torch.nn.Module", "return the model"]),
    "raises": ("def build_model():\n    raise ValueError('hidden must be even')\n",
               ["build_model()", "raised", "ValueError: hidden must be even", "line 2", "meta"]),
    "reads tensor values": ("import torch\n\ndef build_model():\n    torch.ones(2).sum().item()\n",
                            ["build_model()", "line 4", "must not read tensor values"]),
}


@pytest.mark.parametrize("case", sorted(BAD_BUILDS))
def test_bad_build_model_raises_a_helpful_error(tmp_path, case):
    source, expected = BAD_BUILDS[case]
    model_file = load_model_file(write(tmp_path, source))
    with pytest.raises(ModelLoadError) as caught:
        model_file.build(device="meta")
    for text in expected:
        assert text in str(caught.value), (text, str(caught.value))


def test_missing_file_says_what_to_pass(tmp_path):
    with pytest.raises(ModelLoadError) as caught:
        load_model_file(tmp_path / "nope.py")
    message = str(caught.value)
    assert "does not exist" in message and "build_model()" in message and "gpt:" in message


def test_failed_import_leaves_no_module_behind(tmp_path):
    import sys

    before = set(sys.modules)
    with pytest.raises(ModelLoadError):
        load_model_file(write(tmp_path, "raise ImportError('x')\n"))
    assert not [name for name in set(sys.modules) - before if name.startswith("zplan_user_model_")]
    assert str(tmp_path.resolve()) not in sys.path


HF_LLAMA_FOR_TRAINING = """
from transformers import AutoModelForCausalLM, LlamaConfig

def build_model():
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, use_cache=False), attn_implementation="sdpa")
"""


def test_hf_models_see_whole_sequences_on_meta_and_fake_tensors_and_their_own_values_on_real_ones(tmp_path):
    """A model built from a model file, set up for training (use_cache=False), runs its forward on meta tensors
    (transformers would read the position ids' values to look for packed sequences); on real tensors transformers'
    own answers stand: positions that restart are packed, a mask with a zero is padding."""
    pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = load_model_file(write(tmp_path, HF_LLAMA_FOR_TRAINING)).build(device="meta")
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    assert model(ids).logits.shape == (2, 8, 64)
    assert model(ids, attention_mask=torch.ones_like(ids)).logits.shape == (2, 8, 64)

    from transformers import masking_utils

    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert masking_utils.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1, 1]]
    assert masking_utils.find_packed_sequence_indices(torch.arange(6)[None]) is None
    assert masking_utils.find_packed_sequence_indices(packed.to("meta")) is None
    assert not masking_utils.fast_all(torch.tensor([[1, 1, 0]]))
    assert masking_utils.fast_all(torch.ones(1, 3, device="meta")) is True
    with FakeTensorMode():
        assert masking_utils.find_packed_sequence_indices(torch.zeros(1, 6, dtype=torch.long)) is None


HF_GPT2_WITH_PAD_TOKEN = """
from transformers import AutoModelForCausalLM, GPT2Config

def build_model():
    return AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16, pad_token_id=0, use_cache=False),
        attn_implementation="eager")
"""


def test_a_pad_token_in_the_config_is_looked_for_only_in_real_ids(tmp_path, monkeypatch):
    """GPT-2 with a pad_token_id looks for it at the ends of input_ids (to warn of padding without a mask): on meta
    ids there is nothing to look in and the forward runs; real ids are still looked in."""
    pytest.importorskip("transformers")
    model = load_model_file(write(tmp_path, HF_GPT2_WITH_PAD_TOKEN)).build(device="meta")
    assert model(torch.zeros(2, 8, dtype=torch.long, device="meta")).logits.shape == (2, 8, 64)
    real = load_model_file(write(tmp_path, HF_GPT2_WITH_PAD_TOKEN)).build(device="cpu")
    looked = []
    monkeypatch.setattr(type(real.config), "pad_token_id", property(lambda config: looked.append(1) or 0),
                        raising=False)
    real(torch.zeros(1, 4, dtype=torch.long))  # padding (id 0) at both ends, no attention mask
    assert looked  # transformers' own check read the pad token id to look for it


def test_hf_attention_on_fake_tensors_is_the_real_ones_for_an_attention_mask_of_ones(tmp_path, monkeypatch):
    """Context parallel hands a Hugging Face model its tokens' global positions and an attention mask of ones
    (runtime.parallel.context_parallel): on real tensors transformers reads the ones and calls
    scaled_dot_product_attention with
    is_causal, no mask and the grouped key/value heads as they are; on fake tensors (the dry run) it must do the same,
    not build a (b, 1, s, s) mask and repeat the heads, bytes the real run never holds."""
    pytest.importorskip("transformers")
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((key.shape[1], attn_mask is None, kwargs.get("is_causal", False)))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = load_model_file(write(tmp_path, HF_LLAMA_FOR_TRAINING)).build(device="cpu")  # 2 heads, 1 key/value head
    ids, positions = torch.zeros(1, 4, dtype=torch.long), torch.tensor([[0, 1, 6, 7]])  # cp rank 0 of 2, s = 8
    model(ids, position_ids=positions, attention_mask=torch.ones_like(ids))
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        model(fake.from_tensor(ids), position_ids=fake.from_tensor(positions),
              attention_mask=fake.from_tensor(torch.ones_like(ids)))
    assert calls == [(1, True, True)] * 2  # real, then fake: one key/value head, no mask, is_causal
