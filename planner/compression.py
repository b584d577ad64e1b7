"""Compression as the planner sees it: `--compress` parsed, what each setting needs of the configuration, the
candidates that support it, and the decision the report shows.

What each setting needs of the configuration (ZeRO stages, tp, pp, offload) is data in schemas.legality
(COMPRESSION_NEEDS and the rules made of it), as runtime/compression/ and runtime/parallel/data_parallel.py run it.
int4 activations, 1-bit weights and other values are refused by parse_compress, naming what is allowed. A pin
that contradicts a setting, or two settings that contradict each other, fail in check_compression before any
search. Choices left free are narrowed instead: the search keeps only the configurations that support the
setting (the table's rules, in planner.enumerate), so the plan is the fastest that can run compressed; rejecting
the search's unconstrained winner would leave the user without a plan.

The planner never turns compression on by itself: it changes the numerics (int8 rounding; 1-bit Adam's frozen
variance and sign-compressed momentum). It suggests it: where the plan without compression spends at least
SUGGEST_DATA_PARALLEL_SHARE of its step in data-parallel / ZeRO collectives, every setting its configuration
supports is priced by the cost model (planner.cost.compression) on the same configuration and stage partition,
and the report shows what each saves or costs per step and the bytes it sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

import numpy as np

from zplan.errors import SpecError
from zplan.planner.cost.compression import wire_bytes_per_step
from zplan.planner.cost.inputs import (
    ACTIVATION_COMPRESSION,
    GRAD_COMPRESSION,
    WEIGHT_COMPRESSION,
    Candidates,
    ModelNumbers,
)
from zplan.planner.cost.memory import element_bytes
from zplan.planner.cost.step import StepEstimate, estimate_step
from zplan.planner.cost.units import unit_costs
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.legality import (
    COMPRESSION_FIELDS,
    COMPRESSION_NEEDS,
    PP_WORDS,
    Needs,
    applicable,
    config,
    legal_mask,
    needs_words,
    satisfiable,
    zero_words,
)
from zplan.schemas.model import ModelSummary
from zplan.schemas.plan import CompressionDecision, CompressionOption
from zplan.schemas.spec import ONE_BIT_WARMUP_STEPS, CompressionConfig, Pins, TrainSpec

if TYPE_CHECKING:
    from zplan.planner.search import Choice

# Share of the step (without compression) in data-parallel / ZeRO collectives from which the report prices the
# compression options: below it, even removing that communication entirely would gain under a fifth of the step.
SUGGEST_DATA_PARALLEL_SHARE = 0.20
# --compress key -> (CompressionConfig field, allowed values)
COMPRESS_KEYS = {"grad": ("grad", GRAD_COMPRESSION), "weights": ("weights", WEIGHT_COMPRESSION),
                 "act": ("activations", ACTIVATION_COMPRESSION)}


def parse_compress(text: str) -> CompressionConfig:
    """'grad=int8,weights=int8,act=int8' (any subset; 'none' allowed, alone or as a value: the text
    CompressionConfig.as_option gives) -> CompressionConfig; SpecError naming what is allowed for bad syntax, unknown
    keys, repeated keys and unsupported values (int4 activations...)."""
    allowed = ", ".join(f"{key}={'|'.join(values)}" for key, (_, values) in COMPRESS_KEYS.items())
    if text.strip().lower() == "none":
        return CompressionConfig()
    chosen: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = (piece.strip().lower() for piece in part.partition("="))
        if not sep or not key or not value:
            raise SpecError(f"--compress takes key=value pairs separated by commas ({allowed}), or none; got "
                            f"{text!r}.")
        if key not in COMPRESS_KEYS:
            raise SpecError(f"--compress has no key {key!r}: the keys are grad, weights and act ({allowed}).")
        field, values = COMPRESS_KEYS[key]
        if field in chosen:
            raise SpecError(f"--compress gives {key} twice ({text!r}): give each key once.")
        if value not in values:
            raise SpecError(f"--compress {key}={value} is not supported: {key} takes {' or '.join(values)}.")
        chosen[field] = value
    return CompressionConfig(**chosen)


def needs(config: CompressionConfig) -> list[Needs]:
    """The needs of every setting the config turns on (schemas.legality.COMPRESSION_NEEDS)."""
    return [COMPRESSION_NEEDS[(field, value)] for field, value in config.model_dump().items() if value != "none"]


def check_compression(config: CompressionConfig | None, pins: Pins, gpus: int, delayed_update: str = "auto") -> None:
    """Settings that contradict each other, the pins, the GPU count or --delayed-update on fail here, before any
    search, with what to change (module docstring)."""
    if config is None:
        return
    settings = needs(config)
    for a, b in combinations(settings, 2):
        if not set(a.zero) & set(b.zero):
            raise SpecError(f"--compress {a.option} and {b.option} contradict: {a.option} needs "
                            f"{zero_words(a.zero)} ({a.why}), {b.option} needs {zero_words(b.zero)} ({b.why}). "
                            "Drop one of them.")
        if {a.pp, b.pp} == {"one", "many"}:
            raise SpecError(f"--compress {a.option} and {b.option} contradict: {a.option} needs {PP_WORDS[a.pp]}, "
                            f"{b.option} needs {PP_WORDS[b.pp]}. Drop one of them.")
    for need in settings:
        fail = f"--compress {need.option} needs {{}} ({need.why}), but {{}}: {{}}."
        if pins.zero is not None and pins.zero not in need.zero:
            raise SpecError(fail.format(zero_words(need.zero), f"--zero {pins.zero} is pinned",
                                        f"pin --zero {need.zero[-1]}, drop --zero, or drop {need.option}"))
        if need.tp_one and (pins.tp or 1) > 1:
            raise SpecError(fail.format("tp = 1", f"--tp {pins.tp} is pinned", f"drop --tp or {need.option}"))
        if need.tp_one and pins.sequence_parallel:
            raise SpecError(fail.format("tp = 1", "--sequence-parallel needs tp > 1",
                                        f"drop --sequence-parallel or {need.option}"))
        if need.pp == "one" and ((pins.pp or 1) > 1 or (pins.interleave or 1) > 1):
            pinned = f"--pp {pins.pp} is pinned" if (pins.pp or 1) > 1 else "--interleave needs a pipeline"
            raise SpecError(fail.format("pp = 1", pinned, f"drop it or {need.option}"))
        if need.pp == "many" and (pins.pp == 1 or gpus == 1):
            pinned = "--pp 1 is pinned" if pins.pp == 1 else "one GPU has no pipeline"
            raise SpecError(fail.format("pp > 1", pinned, f"pin --pp 2 or more on 2 or more GPUs, or drop "
                                        f"{need.option}"))
        if need.no_offload and pins.offload in ("cpu", "nvme"):
            raise SpecError(fail.format("no offload", f"--offload {pins.offload} is pinned",
                                        f"drop --offload or {need.option}"))
        if delayed_update == "on" and not _runs_with_delayed_update(need):
            raise SpecError(fail.format(zero_words(need.zero), "--delayed-update on needs ZeRO 1 with CPU offload",
                                        f"pass --delayed-update auto, or drop {need.option}"))


def check_model_for_compression(config: CompressionConfig | None, summary: ModelSummary) -> None:
    """act=int8 packs each row of H int8 values into H/4 fp32 words (runtime.compression.activations): H must
    divide by 4."""
    if config is not None and config.activations == "int8" and summary.hidden % 4:
        raise SpecError(f"--compress act=int8 needs the hidden size to divide by 4 (the runtime packs 4 int8 values "
                        f"a word), and {summary.name} has hidden {summary.hidden}: drop act=int8.")


def _runs_with_delayed_update(need: Needs) -> bool:
    """Whether some configuration runs the setting with the delayed parameter update (schemas.legality)."""
    fixed = config(delayed_update=1, **{need.field: need.value})
    return satisfiable(fixed, applicable(dict.fromkeys((*fixed, "zero", "offload", "tp", "pp"))))


def supported_mask(config_: CompressionConfig, tp: np.ndarray, pp: np.ndarray, zero: np.ndarray,
                   offload: np.ndarray | None = None) -> np.ndarray:
    """Which configurations (arrays over candidates; offload: tier codes, 0 = none) support every setting of
    `config_`: the rules of schemas.legality over the compression, tp, pp, ZeRO and, where given, offload."""
    values = {**config(**config_.model_dump()), "tp": tp, "pp": pp, "zero": zero}
    if offload is not None:
        values["offload"] = offload
    rules = [rule for rule in applicable(values) if set(rule.fields) & set(COMPRESSION_FIELDS)]
    return np.broadcast_to(legal_mask(values, rules), np.shape(tp)).copy()


def config_of(cand: Candidates, i: int = 0) -> CompressionConfig:
    """The compression setting of candidate i."""
    return CompressionConfig(grad=GRAD_COMPRESSION[int(cand.grad_compress[i])],
                             weights=WEIGHT_COMPRESSION[int(cand.weight_compress[i])],
                             activations=ACTIVATION_COMPRESSION[int(cand.act_compress[i])])


def _with(cand: Candidates, config: CompressionConfig) -> Candidates:
    return cand.with_compression(config.grad, config.weights, config.activations)


def _options_to_suggest(config: CompressionConfig) -> list[CompressionConfig]:
    """The plan's config with one more data-parallel setting turned on: each gradient compression where gradients
    are not compressed, int8 weights where weights are not."""
    options = [config.model_copy(update={"grad": grad}) for grad in GRAD_COMPRESSION[1:] if config.grad == "none"]
    if config.weights == "none":
        options.append(config.model_copy(update={"weights": "int8"}))
    return options


def _seconds(seconds: float) -> str:
    seconds = abs(seconds)
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def _bytes(num_bytes: float) -> str:
    return f"{num_bytes / 1024**3:.2f} GiB" if num_bytes >= 1024**3 else f"{num_bytes / 1024**2:.1f} MiB"


@dataclass(frozen=True)
class _Priced:
    """One setting on the chosen configuration: its estimate and bytes sent per GPU per step by kind."""

    config: CompressionConfig
    estimate: StepEstimate
    wire: dict[str, float]


def compression_decision(summary: ModelSummary, cluster: ClusterSpec, train: TrainSpec, choice: Choice,
                         step_time_s: float) -> CompressionDecision:
    """The effect of the chosen candidate's compression (against none) and, where the plan without compression
    spends at least SUGGEST_DATA_PARALLEL_SHARE of its step in data-parallel collectives, the price of every other
    setting its configuration supports (module docstring). `step_time_s`: the plan's predicted step."""
    cand, config = choice.candidate, config_of(choice.candidate)
    model = ModelNumbers.from_summary(summary)
    units = unit_costs(summary, cand, cluster, train.precision)  # compression does not change them
    stage_blocks = np.array([choice.partition.max_cost_s * int(cand.interleave[0]) / units.block_time_s])
    elem = element_bytes(train.precision)

    def price(setting: CompressionConfig) -> _Priced:
        one = _with(cand, setting)
        est = estimate_step(model, one, cluster, train.precision, train.global_batch, stage_blocks=stage_blocks)
        wire = wire_bytes_per_step(one, est.memory.stage_params, est.num_micro_batches, summary.seq_len,
                                   summary.hidden, elem)
        return _Priced(setting, est, {kind: float(getattr(wire, kind)[0])
                                      for kind in ("gradients", "weights", "activations")})

    chosen, plain = price(config), price(CompressionConfig())
    plain_step = float(plain.estimate.step_time_s[0])
    share = float(plain.estimate.data_parallel_s[0]) / plain_step if plain_step else 0.0
    applied = _option(chosen, plain, step_time_s) if config.enabled else None
    suggestions = []
    if share >= SUGGEST_DATA_PARALLEL_SHARE:
        for option in _options_to_suggest(config):
            if supported_mask(option, cand.tp, cand.pp, cand.zero)[0]:
                priced = price(option)
                saved = float(chosen.estimate.step_time_s[0] - priced.estimate.step_time_s[0])
                suggestions.append(_option(priced, chosen, step_time_s - saved))
    return CompressionDecision(data_parallel_share=share, applied=applied, suggestions=suggestions,
                               reason=_reason(applied, suggestions, share, cand, cluster, plain_step))


def _changed_kinds(setting: CompressionConfig, base: CompressionConfig) -> list[str]:
    return [kind for kind, field in (("gradients", "grad"), ("weights", "weights"), ("activations", "activations"))
            if getattr(setting, field) != getattr(base, field)]


def _option(priced: _Priced, base: _Priced, step_time_s: float) -> CompressionOption:
    """`priced` against `base` (the same configuration, other compression): the step it saves and the bytes of
    the collectives the two settings compress differently."""
    kinds = _changed_kinds(priced.config, base.config)
    return CompressionOption(
        compress=priced.config.as_option(), step_time_s=step_time_s,
        saved_s=float(base.estimate.step_time_s[0] - priced.estimate.step_time_s[0]),
        wire_bytes=sum(priced.wire[k] for k in kinds), uncompressed_wire_bytes=sum(base.wire[k] for k in kinds),
        fits=bool(priced.estimate.memory.fits[0]))


def _effect(option: CompressionOption, verb: str) -> str:
    """'saves 1.2 s per step (10.0 %), sending 3.1 GiB instead of 6.0 GiB per GPU' and its caveats."""
    before = option.step_time_s + option.saved_s
    change = (f"{verb[0]} {_seconds(option.saved_s)} per step ({option.saved_s / before:.1%})" if option.saved_s > 0
              else f"{verb[1]} {_seconds(option.saved_s)} per step ({-option.saved_s / before:.1%})")
    text = (f"{change}, sending {_bytes(option.wire_bytes)} instead of {_bytes(option.uncompressed_wire_bytes)} "
            f"per GPU")
    if "grad=1bit" in option.compress:
        text += f" (1-bit Adam after its {ONE_BIT_WARMUP_STEPS} exact warm-up steps)"
    if not option.fits:
        text += ", but would not fit memory"
    return text


def _reason(applied: CompressionOption | None, suggestions: list[CompressionOption], share: float,
            cand: Candidates, cluster: ClusterSpec, plain_step: float) -> str:
    parts = []
    if applied is not None:
        parts.append(f"on (--compress {applied.compress}): against the same configuration without compression it "
                     f"{_effect(applied, ('saves', 'costs'))}.")
    where = f"Data-parallel / ZeRO collectives take {share:.1%} of the {_seconds(plain_step)} step without compression"
    if share < SUGGEST_DATA_PARALLEL_SHARE:
        parts.append(f"{where}, under the {SUGGEST_DATA_PARALLEL_SHARE:.0%} from which zplan suggests it.")
    elif not suggestions and applied is not None:
        parts.append(f"{where}.")
    elif not suggestions:
        needed = "; ".join(f"{need.option} needs {needs_words(need)}" for need in COMPRESSION_NEEDS.values()
                           if need.field != "activations")
        parts.append(f"{where}, but no --compress setting applies to ZeRO-{int(cand.zero[0])} with "
                     f"tp = {int(cand.tp[0])} and pp = {int(cand.pp[0])} ({needed}).")
    else:
        effects = "; ".join(f"--compress {o.compress} {_effect(o, ('would save', 'would cost'))}" for o in suggestions)
        parts.append(f"{where}: {effects}.")
        span_nodes = int(cand.tp[0] * cand.dp[0]) > cluster.link_domain()
        if span_nodes and any(o.saved_s <= 0 and "grad=" in o.compress for o in suggestions):
            parts.append("Compressed gradients travel by a direct all-to-all: across nodes each GPU sends its whole "
                         "compressed tensor on its own link, where the hierarchical all-reduce of the uncompressed "
                         f"gradients sends about 2/{cluster.link_domain()} of theirs.")
    text = " ".join(parts)
    return text if applied is not None else f"off: {text}"
