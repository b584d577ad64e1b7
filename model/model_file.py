"""Load a user's model file: a Python file that defines build_model() and, optionally, hooks.

The contract (the file needs no zplan import; zplan executes it, so only load files you trust):
  build_model(**overrides) -> torch.nn.Module        required; zplan calls it under torch.device("meta")
  example_inputs(batch_size, seq_len)                 default: token ids, a LongTensor (B, T) of zeros
  loss_fn(outputs, batch) -> scalar Tensor            default: next-token cross-entropy on logits (B, T, V)
  train_data(batch_size, seq_len, seed=0)             default: endless random tokens (B, T) in [0, VOCAB_SIZE)
  SEQ_LEN = int, VOCAB_SIZE = int                     optional constants: default sequence length, vocabulary

A batch from train_data is what the model is called with (model(batch) for a Tensor, model(**batch) for a
dict) and what loss_fn receives with the model's outputs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import itertools
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from zplan.errors import ModelLoadError
from zplan.model.cross_entropy import can_overwrite, in_place_cross_entropy, shifted_targets
from zplan.model.hf_folder import read_hf_folder

_module_counter = itertools.count()


def hf_models_see_whole_sequences() -> None:
    """Tell transformers that the sequences of a forward on meta or fake tensors are neither packed nor padded.

    transformers (5.x) reads values to choose its attention mask: positions that restart mean packed sequences
    (masking_utils.find_packed_sequence_indices, asked when the model gets no attention mask and no cache, as a
    model set up for training with use_cache=False is called), an attention mask of all ones means no padding
    (fast_all, _ignore_bidirectional_mask_sdpa, _ignore_causal_mask_sdpa: the last returns "build a mask" for any
    padding mask it cannot read, before asking fast_all). A meta tensor has no values (the forward fails: "Tensor.item()
    cannot be called on meta tensors") and a fake tensor none to read either (transformers then takes the sequences
    for packed and builds a (b, 1, s, s) mask and repeats the grouped key/value heads, bytes the real run never
    holds). zplan's batches are whole sequences (positions 0..s-1, an attention mask of ones), so on meta and fake
    tensors the answer is the one their real values give, the one flash attention runs on (is_causal, no mask);
    on real tensors transformers' own functions answer. Every forward zplan makes of a model built from a model
    file (trace, traits, dry run, training) comes after this; installing is idempotent.
    """
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or getattr(masking, "zplan_whole_sequences", False):
        return
    answers = {  # function -> its answer when its tensor argument has no values
        "find_packed_sequence_indices": lambda original, position_ids: None,  # not packed
        "fast_all": lambda original, tensor: True,  # an attention mask of ones: no padding
        "_ignore_bidirectional_mask_sdpa": lambda original, padding_mask, *args, **kwargs:
            original(None, *args, **kwargs),  # no padding mask
        # a causal model handed an attention mask of ones (context parallel's batches:
        # runtime.parallel.context_parallel)
        "_ignore_causal_mask_sdpa": lambda original, padding_mask, *args, **kwargs:
            original(None, *args, **kwargs),  # no padding mask: is_causal, the grouped heads not repeated
    }
    for name, answer in answers.items():
        if callable(getattr(masking, name, None)):
            setattr(masking, name, _unless_values(getattr(masking, name), answer))
    # a padding token id in the config makes the forward look for it at the ends of input_ids, to warn (GPT-2)
    model_class = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    warn = getattr(model_class, "warn_if_padding_and_no_attention_mask", None)
    if callable(warn):
        model_class.warn_if_padding_and_no_attention_mask = _warns_only_with_values(warn)
    masking.zplan_whole_sequences = True


def _warns_only_with_values(warn: Callable) -> Callable:
    """PreTrainedModel.warn_if_padding_and_no_attention_mask, silent where input_ids have no values to look in."""
    @functools.wraps(warn)
    def call(self: Any, input_ids: Any, attention_mask: Any) -> None:
        if not (isinstance(input_ids, torch.Tensor) and (input_ids.is_meta or is_fake(input_ids))):
            warn(self, input_ids, attention_mask)
    return call


def _unless_values(original: Callable, answer: Callable) -> Callable:
    """original(tensor, ...) where `tensor` holds values, else answer(original, tensor, ...)."""
    @functools.wraps(original)
    def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and (tensor.is_meta or is_fake(tensor)):
            return answer(original, tensor, *args, **kwargs)
        return original(tensor, *args, **kwargs)
    return call


def default_example_inputs(batch_size: int, seq_len: int) -> torch.Tensor:
    """Token ids (B, T) on the current default device (meta while zplan traces)."""
    return torch.zeros(batch_size, seq_len, dtype=torch.long)


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in a model's outputs: the tensor itself, `.logits` (Hugging Face), or the first item."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if getattr(outputs, "logits", None) is not None:
        return outputs.logits
    if isinstance(outputs, dict) and "logits" in outputs:
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(f"cannot find logits in model outputs of type {type(outputs).__name__}: "
                    "return a (B, T, V) tensor or define loss_fn(outputs, batch) in the model file")


def next_token_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from tokens <= t: logits (B, T, V), batch ids (B, T). Plain logits
    take the in-place cross-entropy (model/cross_entropy.py: the gradient written over the logits, nothing more held)
    where it may overwrite them (can_overwrite: in training, made by the head's matmul); a DTensor (split over the
    vocabulary: torch's loss_parallel computes its loss), logits without a gradient (validation) and logits an op
    keeps F.cross_entropy on an fp32 upcast."""
    logits = logits_of(outputs)
    tokens = batch["input_ids"] if isinstance(batch, dict) else batch  # (B, T)
    flat = logits.flatten(0, 1) if not isinstance(logits, DTensor) else None
    if flat is not None and flat.is_contiguous() and can_overwrite(flat):
        return in_place_cross_entropy(flat, shifted_targets(tokens))
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def synthetic_tokens(batch_size: int, seq_len: int, vocab_size: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless batches of uniformly random token ids (B, T) in [0, vocab_size)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)


def call_with_supported_kwargs(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call a user hook with the keyword arguments its signature accepts (all of them if it has **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return fn(*args, **kwargs)
    names = {p.name for p in parameters}
    return fn(*args, **{key: value for key, value in kwargs.items() if key in names})


@dataclass
class ModelFile:
    """A loaded model file: its hooks (defaults filled in), its identity and the sizes it declares."""

    path: Path
    sha256: str  # of the file's bytes: the plan's fingerprint of the model source
    module: types.ModuleType
    build_model: Callable[..., nn.Module]
    example_inputs: Callable[[int, int], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    user_train_data: Callable[..., Iterator] | None  # the file's train_data hook, if it has one
    vocab_size: int | None  # VOCAB_SIZE; after build(): the largest nn.Embedding if none or sizes were passed
    seq_len: int | None  # SEQ_LEN, if the file defines it

    @property
    def name(self) -> str:
        return self.path.stem

    def build(self, device: str | torch.device | None = None, **overrides: Any) -> nn.Module:
        """build_model(**overrides) under `device` (e.g. "meta"); errors become ModelLoadError."""
        on_meta = device is not None and torch.device(device).type == "meta"
        try:
            with contextlib.ExitStack() as stack:
                if device is not None:
                    stack.enter_context(torch.device(device))
                if on_meta:
                    stack.enter_context(SkipMetaInit())
                model = self.build_model(**overrides)
        except Exception as exc:
            where = f" under torch.device({str(device)!r})" if device is not None else ""
            raise ModelLoadError(
                f"build_model() in {self.path} raised{where}: {_exception_line(exc, self.path)}. Fix "
                "build_model(); zplan plans on the meta device, so it must not read tensor values or load "
                "checkpoints: build the model from its config (AutoModelForCausalLM.from_config) and start from "
                "the weights with train.py --init-from PATH, or compile the Hugging Face folder itself."
            ) from exc
        if not isinstance(model, nn.Module):
            raise ModelLoadError(
                f"build_model() in {self.path} returned {type(model).__name__}, not a torch.nn.Module: "
                "return the model object itself, e.g. `return GPT(...)`."
            )
        if self.vocab_size is None or overrides:  # sizes passed to build_model may change VOCAB_SIZE's
            self.vocab_size = largest_embedding_rows(model) or self.vocab_size
        return model

    def train_data(self, batch_size: int, seq_len: int, seed: int = 0, **extra: Any) -> Iterator:
        """Batches for training: the file's train_data hook, else synthetic_tokens over VOCAB_SIZE."""
        if self.user_train_data is not None:
            return call_with_supported_kwargs(self.user_train_data, batch_size, seq_len, seed=seed, **extra)
        if self.vocab_size is None:
            raise ModelLoadError(
                f"{self.path}: cannot make synthetic tokens without a vocabulary size: define "
                "VOCAB_SIZE = <int> or a train_data(batch_size, seq_len) hook in the model file."
            )
        return synthetic_tokens(batch_size, seq_len, self.vocab_size, seed)


class SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Skips in-place initialisation of meta tensors: torch.nn.init's functions (normal_, kaiming_uniform_,
    ...) and in-place Tensor methods under no_grad. Meta tensors hold no values, and each such call costs
    milliseconds in Python decompositions (most of the time of building a 175B GPT)."""

    INIT_METHODS = frozenset({"normal_", "uniform_", "zero_", "fill_", "erfinv_", "mul_", "add_", "clamp_",
                              "copy_", "exponential_", "log_normal_", "random_", "bernoulli_", "div_", "sub_"})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        init_function = getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_")
        in_place = name in self.INIT_METHODS and not torch.is_grad_enabled()
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes tensor=... by keyword
        if (init_function or in_place) and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def largest_embedding_rows(model: nn.Module) -> int | None:
    """Rows of the largest nn.Embedding (the token embedding in a language model), or None."""
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(rows) if rows else None


def load_model_file(path: str | Path) -> ModelFile:
    """Import a model file under a unique module name and check its contract (not yet building)."""
    file = Path(path)
    if file.is_dir():  # a Hugging Face folder: the model of its config.json (model/hf_folder.py)
        folder = read_hf_folder(file)
        return ModelFile(path=file, sha256=folder.sha256, module=folder.module,
                         build_model=_models_see_whole_sequences_after(folder.build_model),
                         example_inputs=default_example_inputs, loss_fn=next_token_loss, user_train_data=None,
                         vocab_size=folder.vocab_size, seq_len=folder.seq_len)
    if not file.is_file():
        raise ModelLoadError(
            f"model file {str(path)!r} does not exist: pass the path to a Python file that defines "
            "build_model() (e.g. examples/tiny.py), or a family spec such as 'gpt:layers=24,hidden=2048,heads=16'."
        )
    source = file.read_bytes()
    sha256 = hashlib.sha256(source).hexdigest()
    module = _import_file(file, f"zplan_user_model_{sha256[:12]}_{next(_module_counter)}")

    build_model = getattr(module, "build_model", None)
    if not callable(build_model):
        functions = [name for name, value in vars(module).items()
                     if inspect.isfunction(value) and value.__module__ == module.__name__]
        listed = f" (it defines: {', '.join(functions[:6])})" if functions else ""
        raise ModelLoadError(
            f"{file} has no build_model() function{listed}: add `def build_model() -> torch.nn.Module` "
            "that returns the model, as in examples/tiny.py."
        )
    hooks = {}
    for hook in ("example_inputs", "loss_fn", "train_data"):
        value = getattr(module, hook, None)
        if value is not None and not callable(value):
            raise ModelLoadError(f"{file}: {hook} is a {type(value).__name__}, not a function: define "
                                 f"`def {hook}(...)` or remove it to use zplan's default.")
        hooks[hook] = value
    return ModelFile(
        path=file,
        sha256=sha256,
        module=module,
        build_model=_models_see_whole_sequences_after(build_model),
        example_inputs=hooks["example_inputs"] or default_example_inputs,
        loss_fn=hooks["loss_fn"] or next_token_loss,
        user_train_data=hooks["train_data"],
        vocab_size=_int_constant(module, "VOCAB_SIZE", file),
        seq_len=_int_constant(module, "SEQ_LEN", file),
    )


def _models_see_whole_sequences_after(build_model: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """build_model, then hf_models_see_whole_sequences: transformers' modeling code (masking_utils with it) is
    imported when a model is built, not when the model file is."""
    @functools.wraps(build_model)
    def build(*args: Any, **overrides: Any) -> nn.Module:
        model = build_model(*args, **overrides)
        hf_models_see_whole_sequences()
        return model
    return build


def _import_file(file: Path, module_name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{file} cannot be imported as Python: give the model file a .py name.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    sys.path.insert(0, str(file.parent.resolve()))  # the file may import its siblings
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(module_name, None)
        raise ModelLoadError(
            f"importing {file} failed: {_exception_line(exc, file)}. Fix the file; `python {file}` shows the "
            "full traceback."
        ) from exc
    finally:
        sys.path.remove(str(file.parent.resolve()))
    return module


def _int_constant(module: types.ModuleType, name: str, file: Path) -> int | None:
    value = getattr(module, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{file}: {name} = {value!r} must be a positive int; fix or remove it.")
    return value


def _exception_line(exc: BaseException, file: Path) -> str:
    """'TypeError: message (line 12)', the line being the deepest frame inside the model file."""
    line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == file.resolve():
            line = frame.lineno
    if isinstance(exc, SyntaxError):
        message = f"{exc.msg}: {exc.text.strip()}" if exc.text else str(exc.msg)
    else:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"{text} (line {line})" if line else text
