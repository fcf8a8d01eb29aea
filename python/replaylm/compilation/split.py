"""Split an FX graph at opaque ops: the pass behind tc_piecewise.

Every call of a splitting op (attention) becomes a submodule of its own; the nodes between two
such calls form one compute piece. A model with n attention calls (compute before the first, between
each two, and after the last) gives n + 1 compute pieces.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch.fx as fx
from torch.fx.passes.split_module import split_module


@dataclass(frozen=True)
class Piece:
    """One submodule of the split graph, in execution order."""

    name: str  # attribute of the split GraphModule (`submod_<i>`)
    opaque: bool  # a splitting op (runs as is), or a compute piece (compiled)


@dataclass
class SplitGraph:
    module: fx.GraphModule  # calls its pieces in order
    pieces: list[Piece]

    @property
    def compute_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if not p.opaque]


def _is_split_op(node: fx.Node, split_ops: Collection[object]) -> bool:
    return node.op == "call_function" and node.target in split_ops


def split_at_ops(gm: fx.GraphModule, split_ops: Collection[object]) -> SplitGraph:
    """Partition `gm` so that each call of an op in `split_ops` (OpOverloads or their packets)
    sits alone in a submodule, with compute pieces between; order is preserved."""
    partition: dict[fx.Node, int] = {}
    opaque_ids: set[int] = set()
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_split_op(node, split_ops):
            partition[node] = current + 1
            opaque_ids.add(current + 1)
            current += 2
        else:
            partition[node] = current
    module = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)
    pieces = [
        Piece(node.target, int(node.target.rsplit("_", 1)[1]) in opaque_ids)
        for node in module.graph.nodes
        if node.op == "call_module"
    ]
    return SplitGraph(module, pieces)
