"""Which combinations of the plan's choices are legal: one table of rules, each a name, the fields it reads, a
condition over them, the reason a user reads and the fix. What the runtime can run per model trait is the other table,
schemas.capability; sizes (tp divides the heads, pp <= the blocks) are the enumerator's (planner.enumerate).

A condition uses only ==, !=, <, <=, >, >=, & and | on its fields, so the same condition evaluates on Python scalars
(one configuration: zplan.api's pin checks, runtime.plan.check, the runtime's refusals) and on numpy arrays (the
enumerator's candidate arrays, planner.enumerate; the placement's combinations, planner.placement). Values are ints:
degrees as they are, flags 0/1, and the named choices by their index in NAMES (`config` encodes names), so that
GPU = no offload = 0, CPU = 1, NVMe = 2 and "a state's tier <= the offload tier" reads as it says.

Fields: zero, offload, delayed_update, grad, weights, activations (the --compress settings), tp, pp, cp, ep, interleave,
sequence_parallel, precision; where the model states live: parameters, gradients, optimizer, and offload_pinned (the
offload tier is the user's --offload pin, which places the optimizer states there: planner.placement).
A rule applies to a configuration that gives all of its fields; the others are left to whoever knows them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import reduce
from operator import and_, or_
from typing import Any, get_args

from zplan.schemas.spec import ActivationCompression, GradCompression, Precision, Tier, WeightCompression

NONE = GPU = 0  # no offload; a state on the GPU
CPU = 1
NVME = 2
OFFLOAD_TIERS: tuple[str, ...] = get_args(Tier)  # none, cpu, nvme
STATE_TIERS = ("gpu", "cpu", "nvme")
STATES = ("parameters", "gradients", "optimizer")
COMPRESSION_FIELDS = ("grad", "weights", "activations")  # schemas.spec.CompressionConfig's fields
NAMES: dict[str, tuple[str, ...]] = {
    "offload": OFFLOAD_TIERS, **{state: STATE_TIERS for state in STATES}, "grad": get_args(GradCompression),
    "weights": get_args(WeightCompression), "activations": get_args(ActivationCompression),
    "precision": get_args(Precision)}
# Each field's values; a degree is 1 or "more" (2), which is all a rule asks of it.
DOMAINS: dict[str, tuple[int, ...]] = {
    "zero": (0, 1, 2, 3), "tp": (1, 2), "pp": (1, 2), "cp": (1, 2), "ep": (1, 2), "interleave": (1, 2),
    "sequence_parallel": (0, 1),
    "delayed_update": (0, 1), "offload_pinned": (0, 1), **{f: tuple(range(len(n))) for f, n in NAMES.items()}}
OPTION_KEYS = {"grad": "grad", "weights": "weights", "activations": "act"}  # the --compress keys


@dataclass(frozen=True)
class Rule:
    """One legality rule: `condition` takes the values of `fields`, in order, and says where it holds."""

    name: str
    fields: tuple[str, ...]
    condition: Callable[..., Any]
    reason: str  # what the user reads: what the rule says and why
    fix: str  # what to pin or change when a plan breaks it

    def applies(self, values: Mapping[str, Any]) -> bool:
        return all(f in values for f in self.fields)

    def holds(self, values: Mapping[str, Any]) -> Any:
        """True / False on scalars, a boolean array on arrays."""
        return self.condition(*(values[f] for f in self.fields))


def _any_of(x, values: Iterable[int]):
    return reduce(or_, (x == v for v in values))


@dataclass(frozen=True)
class Needs:
    """What one --compress setting needs of the configuration, as runtime/compression/ and
    runtime/parallel/data_parallel.py run it."""

    field: str  # CompressionConfig field
    value: str
    option: str  # e.g. 'grad=int8'
    zero: tuple[int, ...]  # ZeRO stages it runs with
    tp_one: bool  # tensor parallel must be 1
    pp: str  # 'any', 'one' (no pipeline) or 'many' (a pipeline)
    no_offload: bool  # its optimizer steps on the device
    why: str  # the runtime's reason, for messages


COMPRESSION_NEEDS: dict[tuple[str, str], Needs] = {
    ("grad", "int8"): Needs("grad", "int8", "grad=int8", (0, 1), True, "any", False, "it is a DDP communication "
                            "hook on the gradient buckets, which runs with ZeRO 0 or 1 and tensor parallel 1"),
    ("grad", "1bit"): Needs("grad", "1bit", "grad=1bit", (0, 1), True, "one", True, "1-bit Adam runs on a DDP model "
                            "(ZeRO 0, or ZeRO 1 with the gradients compressed), no tensor or pipeline parallelism"),
    ("weights", "int8"): Needs("weights", "int8", "weights=int8", (3,), False, "any", False,
                               "it compresses ZeRO-3's parameter all-gathers"),
    ("activations", "int8"): Needs("activations", "int8", "act=int8", (0, 1, 2, 3), False, "many", False,
                                   "it compresses the hidden states sent between pipeline stages"),
}
PP_WORDS = {"one": "pp = 1", "many": "pp > 1"}


def zero_words(stages: tuple[int, ...]) -> str:
    return "ZeRO " + " or ".join(str(z) for z in stages)


def needs_words(need: Needs) -> str:
    """'ZeRO 0 or 1, tp = 1, pp = 1, no offload': what a setting needs, in a few words."""
    parts = [zero_words(need.zero)] if need.zero != DOMAINS["zero"] else []
    parts += ["tp = 1"] * need.tp_one + [PP_WORDS.get(need.pp, "")] * (need.pp in PP_WORDS)
    parts += ["no offload"] * need.no_offload
    return ", ".join(parts)


def _compression_rules(need: Needs) -> list[Rule]:
    """The rules of one setting: the ZeRO stages, tp, pp and offload it runs with."""
    code, field, fix = NAMES[need.field].index(need.value), need.field, "recompile with a --compress that fits"
    key = f"compress_{need.option.replace('=', '_')}"
    rules = []
    if need.zero != DOMAINS["zero"]:
        rules.append(Rule(f"{key}_zero", (field, "zero"), lambda s, z: (s != code) | _any_of(z, need.zero),
                          f"{need.option} needs {zero_words(need.zero)}: {need.why}", fix))
    if need.tp_one:
        rules.append(Rule(f"{key}_tp", (field, "tp"), lambda s, tp: (s != code) | (tp == 1),
                          f"{need.option} needs tp = 1: {need.why}", fix))
    if need.pp == "one":
        rules.append(Rule(f"{key}_pp", (field, "pp"), lambda s, pp: (s != code) | (pp == 1),
                          f"{need.option} needs pp = 1: {need.why}", fix))
    if need.pp == "many":
        rules.append(Rule(f"{key}_pp", (field, "pp"), lambda s, pp: (s != code) | (pp > 1),
                          f"{need.option} needs pp > 1: {need.why}", fix))
    if need.no_offload:
        rules.append(Rule(f"{key}_offload", (field, "offload"), lambda s, off: (s != code) | (off == NONE),
                          f"{need.option} needs no offload: {need.why}", fix))
    return rules


OFFLOAD_NEEDS_SHARDS = "ZeRO-Offload and ZeRO-Infinity step each rank's optimizer shard, and ZeRO 0 has none"
_CONFIG_RULES = [
    Rule("offload_needs_zero", ("offload", "zero"), lambda off, z: (off == NONE) | (z >= 1),
         f"CPU or NVMe offload needs ZeRO >= 1: {OFFLOAD_NEEDS_SHARDS}",
         "pin --zero 1, 2 or 3"),
    Rule("delayed_update_needs_zero1_cpu", ("delayed_update", "zero", "offload"),
         lambda d, z, off: (d == 0) | ((z == 1) & (off == CPU)),
         "the delayed parameter update runs with ZeRO 1 and the optimizer offloaded to the CPU only: it delays the "
         "CPU step of runtime.optim.host_states", "pin --delayed-update off"),
    Rule("sequence_parallel_needs_tp", ("sequence_parallel", "tp"), lambda sp, tp: (sp == 0) | (tp > 1),
         "sequence parallel needs tp > 1: it splits the tokens between blocks over the tensor-parallel ranks",
         "drop --sequence-parallel or pin --tp > 1"),
    Rule("interleave_needs_pipeline", ("interleave", "pp"), lambda v, pp: (v == 1) | (pp > 1),
         "interleave > 1 needs a pipeline (pp > 1)", "drop --interleave or pin --pp > 1"),
    Rule("context_parallel_without_offload", ("cp", "offload"), lambda cp, off: (cp == 1) | (off == NONE),
         "context parallel runs without offload, as runtime/parallel/context_parallel.py runs it",
         "pin --cp 1 or --offload none"),
    Rule("context_parallel_without_delayed_update", ("cp", "delayed_update"), lambda cp, d: (cp == 1) | (d == 0),
         "context parallel runs without the delayed parameter update, as runtime/parallel/context_parallel.py runs "
         "it", "pin --cp 1 or --delayed-update off"),
    *(Rule(f"context_parallel_without_{field}_compression", ("cp", field), lambda cp, s: (cp == 1) | (s == 0),
           "context parallel runs without compression, as runtime/parallel/context_parallel.py runs it",
           "pin --cp 1, or drop that --compress setting") for field in COMPRESSION_FIELDS),
    Rule("expert_parallel_without_offload", ("ep", "offload"), lambda ep, off: (ep == 1) | (off == NONE),
         "expert parallelism is priced with the model states on the GPU", "pin --ep 1 or --offload none"),
    Rule("expert_parallel_without_context_parallel", ("ep", "cp"), lambda ep, cp: (ep == 1) | (cp == 1),
         "expert parallelism is carved out of the data-parallel ranks, without context parallel",
         "pin --ep 1 or --cp 1"),
    *(Rule(f"expert_parallel_without_{field}_compression", ("ep", field), lambda ep, s: (ep == 1) | (s == 0),
           "expert parallelism is priced without compression", "pin --ep 1, or drop that --compress setting")
      for field in COMPRESSION_FIELDS),
    Rule("nvfp4_needs_tp1", ("precision", "tp"),
         lambda prec, tp: (prec != NAMES["precision"].index("nvfp4")) | (tp == 1),
         "nvfp4 runs with tensor parallel off: runtime/precision/nvfp4.py quantises whole tensors on one rank and "
         "has no tensor-parallel styles", "pin --tp 1"),
    *(rule for need in COMPRESSION_NEEDS.values() for rule in _compression_rules(need)),
]


def _within_offload(state: str) -> Rule:
    return Rule(f"{state}_within_offload", (state, "offload"), lambda tier, off: tier <= off,
                "the offload tier bounds where the model states go: none keeps them on the GPU, cpu allows the host, "
                "nvme NVMe too", "pin --offload cpu or nvme")


# Where the model states may live (planner.placement; the runtime: FSDP2's CPUOffloadPolicy moves the parameter and
# gradient shards of ZeRO 2/3 off the GPU, and the optimizer step with them).
_PLACEMENT_RULES = [
    *(_within_offload(state) for state in STATES),
    Rule("offload_pin_places_optimizer", ("offload_pinned", "optimizer", "offload"),
         lambda pinned, opt, off: (pinned == 0) | (opt == off),
         "an --offload pin is where the optimizer states live (none: the GPU)", "drop --offload"),
    Rule("optimizer_off_gpu_needs_zero", ("optimizer", "zero"), lambda opt, z: (opt == GPU) | (z >= 1),
         f"the optimizer states leave the GPU only with ZeRO >= 1: {OFFLOAD_NEEDS_SHARDS}", "pin --zero 1, 2 or 3"),
    Rule("parameters_off_gpu_need_zero2", ("parameters", "zero"), lambda par, z: (par == GPU) | (z >= 2),
         "the parameters leave the GPU only with ZeRO 2 or 3: FSDP2's CPUOffloadPolicy keeps their shards on the "
         "host", "pin --zero 2 or 3"),
    Rule("parameters_on_nvme_need_zero3", ("parameters", "zero"), lambda par, z: (par != NVME) | (z == 3),
         "only ZeRO 3 shards the parameters and swaps them to NVMe, runtime.offload.param_swap", "pin --zero 3"),
    Rule("gradients_off_gpu_need_zero2", ("gradients", "zero"), lambda grads, z: (grads == GPU) | (z >= 2),
         "the gradients leave the GPU only with ZeRO 2 or 3, FSDP2's sharded gradients", "pin --zero 2 or 3"),
    Rule("gradients_not_on_nvme", ("gradients",), lambda grads: grads <= CPU,
         "the gradients go to the host, never to NVMe", "pin --offload cpu"),
    Rule("gradients_off_gpu_feed_the_optimizer", ("gradients", "optimizer"),
         lambda grads, opt: (grads == GPU) | (opt != GPU),
         "the gradients go to the host only to feed the optimizer's step there", "pin --offload cpu"),
    Rule("sharded_parameters_and_gradients_leave_together", ("zero", "parameters", "gradients"),
         lambda z, par, grads: (z <= 1) | ((par == GPU) == (grads == GPU)),
         "under ZeRO 2/3 the parameters and the gradients leave the GPU together, FSDP2's CPUOffloadPolicy",
         "pin --zero 1 or --offload none"),
    Rule("parameters_off_gpu_take_the_optimizer", ("parameters", "optimizer"),
         lambda par, opt: (par == GPU) | (opt != GPU),
         "parameters off the GPU take the optimizer step with them: FSDP2's CPUOffloadPolicy steps on the host",
         "pin --offload none"),
]
PLACEMENT_RULES: tuple[Rule, ...] = tuple(_PLACEMENT_RULES)
RULES: tuple[Rule, ...] = (*_CONFIG_RULES, *_PLACEMENT_RULES)
BY_NAME: dict[str, Rule] = {rule.name: rule for rule in RULES}


def config(**values: Any) -> dict[str, int]:
    """Values as the rules read them: names (offload 'cpu', grad 'int8', precision 'nvfp4'...) by their code, flags as
    0/1, None dropped (the field is not known). ValueError for a name the field does not have."""
    out = {}
    for field, value in values.items():
        if field not in DOMAINS:
            raise ValueError(f"no legality field {field!r}")
        if value is None:
            continue
        if isinstance(value, str):
            if value not in NAMES.get(field, ()):
                raise ValueError(f"{field} is one of {', '.join(NAMES.get(field, ()))}, got {value!r}")
            value = NAMES[field].index(value)
        out[field] = int(value)
    return out


def compression_values(grad: str = "none", weights: str = "none", activations: str = "none") -> dict[str, int]:
    """A CompressionConfig's settings as fields (config(**c.model_dump()))."""
    return config(grad=grad, weights=weights, activations=activations)


def applicable(values: Mapping[str, Any], rules: Iterable[Rule] = RULES) -> list[Rule]:
    """The rules whose fields `values` all give."""
    return [rule for rule in rules if rule.applies(values)]


def violations(values: Mapping[str, Any], rules: Iterable[Rule] = RULES) -> list[Rule]:
    """The applicable rules one configuration (scalars) breaks, in table order."""
    return [rule for rule in applicable(values, rules) if not bool(rule.holds(values))]


def legal_mask(values: Mapping[str, Any], rules: Iterable[Rule] = RULES) -> Any:
    """Where every applicable rule holds: a boolean array over arrays of values (True on scalars)."""
    return reduce(and_, (rule.holds(values) for rule in applicable(values, rules)), True)


def satisfiable(fixed: Mapping[str, int], rules: Iterable[Rule]) -> bool:
    """Whether some values of the rules' other fields (over DOMAINS) meet every rule with `fixed` as given."""
    rules = list(rules)
    free = sorted({f for rule in rules for f in rule.fields} - set(fixed))
    for combo in itertools.product(*(DOMAINS[f] for f in free)):
        values = {**fixed, **dict(zip(free, combo, strict=True))}
        if all(bool(rule.holds(values)) for rule in rules):
            return True
    return False


def words(field: str, value: int) -> str:
    """One field's value in a message: 'ZeRO 2', 'cpu offload', 'parameters on NVMe', '--compress grad=int8'."""
    place = {"gpu": "the GPU", "cpu": "the CPU", "nvme": "NVMe"}
    if field in COMPRESSION_FIELDS:
        key = OPTION_KEYS[field]
        return f"--compress {key}={NAMES[field][value]}" if value else f"no {key} compression"
    if field in STATES:
        return f"{'the optimizer states' if field == 'optimizer' else field} on {place[STATE_TIERS[value]]}"
    if field in ("zero", "tp", "pp", "interleave"):
        return f"ZeRO {value}" if field == "zero" else f"{field}={value}"
    flags = {"sequence_parallel": "sequence parallel", "delayed_update": "the delayed parameter update",
             "offload_pinned": "an --offload pin"}
    if field in flags:
        return flags[field] if value else f"no {flags[field].removeprefix('the ').removeprefix('an ')}"
    if field == "cp":
        return f"context parallel (cp={value})"
    if field == "ep":
        return f"expert parallel (ep={value})"
    return f"{OFFLOAD_TIERS[value]} offload" if field == "offload" else NAMES[field][value]


def describe(rule: Rule, values: Mapping[str, int]) -> str:
    """What in `values` breaks `rule`: 'nvfp4 with tp=2', 'parameters on NVMe with ZeRO 2'."""
    first, *rest = (words(f, values[f]) for f in rule.fields)
    return f"{first} with {' and '.join(rest)}" if rest else first


def problems(values: Mapping[str, int], rules: Iterable[Rule] = RULES) -> list[str]:
    """'nvfp4 with tp=2: nvfp4 runs with tensor parallel off: ...' for every rule `values` break (the runtime's
    refusals)."""
    return [f"{describe(rule, values)}: {rule.reason}" for rule in violations(values, rules)]
