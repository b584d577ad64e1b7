"""ModelGraph: the traced model as a networkx DiGraph, one node per operation, edges along data flow.

Node attributes (all set by zplan.planner.trace):
  op          normalised operation name: 'linear', 'scaled_dot_product_attention', 'add', 'view', 'input', ...
  target      what ran: a module path for a module call, a function or method name, or an aten op
  module      path of the innermost module that ran the operation ('' at the top level)
  shape       output shape of the operation, a tuple (None for operations that return several tensors)
  dtype       output dtype as a string, e.g. 'torch.float32' (the dtype the model was built with)
  fwd_flops   forward FLOPs for the traced batch (one sample of seq_len tokens)
  bwd_flops   backward FLOPs (2x forward for matmul-like operations, 0 for elementwise ones)
  params      parameters this operation uses first (a tied weight counts once, where it is first used)
  param_bytes params * bytes per element at the compute precision
  act_bytes   bytes this operation saves for backward at the compute precision (see trace.py for the rule)
  block       index of the repeated block the operation belongs to, or None
  unit        pipeline unit: 'embedding', '<block_prefix>.<i>', or 'head'
  tp_style    'colwise' / 'rowwise' for Linear layers split by tensor parallelism, else None

The graph holds numbers and names only; no torch objects survive tracing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import networkx as nx

NODE_ATTRIBUTES = (
    "op", "target", "module", "shape", "dtype", "fwd_flops", "bwd_flops", "params", "param_bytes",
    "act_bytes", "block", "unit", "tp_style",
)
NUMERIC_ATTRIBUTES = ("fwd_flops", "bwd_flops", "params", "param_bytes", "act_bytes")


@dataclass
class ModelGraph:
    """A traced model: operations in execution order, their costs, and its pipeline structure."""

    tracer: str  # 'fx', 'hooks' or 'export'
    block_prefix: str  # module path of the block container, e.g. 'blocks' or 'model.layers'
    num_blocks: int
    seq_len: int
    precision: str
    graph: nx.DiGraph = field(default_factory=nx.DiGraph)

    # -- building ------------------------------------------------------------------------------------

    def add_op(self, name: str, inputs: Iterable[str] = (), **attributes: object) -> None:
        """Add one operation after all previously added ones; `inputs` are the names it reads."""
        unknown = set(attributes) - set(NODE_ATTRIBUTES)
        if unknown:
            raise ValueError(f"unknown node attributes {sorted(unknown)}; known: {NODE_ATTRIBUTES}")
        values = {key: None for key in NODE_ATTRIBUTES}
        values.update({key: 0 for key in NUMERIC_ATTRIBUTES})
        values.update(attributes)
        self.graph.add_node(name, **values)
        for source in inputs:
            self.graph.add_edge(source, name)

    # -- reading -------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.graph.number_of_nodes()

    def __contains__(self, name: str) -> bool:
        return name in self.graph

    def __getitem__(self, name: str) -> dict:
        """The attribute dict of one node."""
        return self.graph.nodes[name]

    def nodes(self) -> list[str]:
        """Node names in execution order (the order they were added)."""
        return list(self.graph.nodes)

    def iter_nodes(self, **where: object) -> Iterator[tuple[str, dict]]:
        """(name, attributes) in execution order, keeping nodes whose attributes equal `where`."""
        for name, data in self.graph.nodes(data=True):
            if all(data.get(key) == value for key, value in where.items()):
                yield name, data

    def nodes_of_block(self, index: int) -> list[str]:
        return [name for name, _ in self.iter_nodes(block=index)]

    def nodes_of_unit(self, unit: str) -> list[str]:
        return [name for name, _ in self.iter_nodes(unit=unit)]

    def units(self) -> list[str]:
        """Pipeline units in execution order: 'embedding', each block, 'head'."""
        seen: dict[str, None] = {}
        for _, data in self.graph.nodes(data=True):
            seen.setdefault(data["unit"], None)
        return list(seen)

    def total(self, attribute: str, nodes: Iterable[str] | None = None) -> float:
        """Sum of a numeric attribute over `nodes` (default: the whole graph)."""
        if attribute not in NUMERIC_ATTRIBUTES:
            raise ValueError(f"{attribute!r} is not numeric; numeric attributes: {NUMERIC_ATTRIBUTES}")
        names = self.graph.nodes if nodes is None else nodes
        return float(sum(self.graph.nodes[name][attribute] for name in names))

    def unit_totals(self, attribute: str) -> dict[str, float]:
        """Sum of a numeric attribute per pipeline unit, in execution order."""
        totals = {unit: 0.0 for unit in self.units()}
        for _, data in self.graph.nodes(data=True):
            totals[data["unit"]] += data[attribute]
        return totals

    def tp_styles(self, block: int = 0) -> dict[str, str]:
        """Module path -> 'colwise' / 'rowwise' for the Linear layers of one block."""
        return {data["module"]: data["tp_style"] for _, data in self.iter_nodes(block=block) if data["tp_style"]}

    def ops_count(self) -> dict[str, int]:
        """How many nodes of each op, for a quick look at what was traced."""
        counts: dict[str, int] = {}
        for _, data in self.graph.nodes(data=True):
            counts[data["op"]] = counts.get(data["op"], 0) + 1
        return counts
