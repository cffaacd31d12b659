"""Splits an ATen FX graph into partitions along its independent branches.

Used by the torch.compile backend (`compile.py`): each partition is
compiled by inductor on its own and runs as one node of the lazy engine, so
independent partitions run side by side on the lanes.

The split works on groups of nodes:
1. every op is a group (a `getitem` belongs to the op it reads);
2. chains are contracted: a group whose only successor has it as its only
   predecessor is merged with that successor (nothing can overlap them);
3. groups too small to pay for a partition's call on a lane (or below a
   sixteenth of the graph's work per lane) are merged into a neighbour:
   their only predecessor (the work stays in the parallel part), else their
   only successor, else the cheapest successor whose merge keeps the graph
   acyclic (an island with no neighbour: the cheapest group), contracting
   chains after each merge;
4. chains are contracted again;
5. if list scheduling the groups over the lanes (each paying a partition's
   call) would not beat running the whole graph as one piece by `MIN_GAIN`,
   the graph stays one partition.

What an op costs, what a partition's call costs and the list schedule are
the engine's own (`_C`: plan/topology.h's estimate_op_work and node_seconds,
plan/plan.h's schedule_tasks), so the split and the plan agree.
"""
import operator

import torch
import torch.fx
from torch.fx.experimental import symbolic_shapes
from torch.utils._pytree import tree_flatten

from . import _C

# The split's one number of its own: how much faster than one piece the
# pieces must be predicted to run before a graph is split at all (costs,
# rates and the schedule are the engine's: `_C`).
MIN_GAIN = 1.15


def op_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1] + ("" if t._overloadname == "default" else "." + t._overloadname)
    return getattr(t, "__name__", str(t))


def _hint(s, fallback):
    """A symbolic size's hint, adding no guard (the fallback where none is known)."""
    if not isinstance(s, torch.SymInt):
        return int(s)
    hint = getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "hint_int", None)
    try:
        return int(hint(s, fallback=fallback))
    except Exception:
        return fallback


def _meta(v):
    """A Meta tensor with `v`'s geometry (symbolic sizes at their hints), for
    the cost model; other values as they are, FX nodes as their values."""
    if isinstance(v, torch.fx.Node):
        v = v.meta.get("val")
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(_hint(s, 64) for s in v.shape), tuple(_hint(s, 1) for s in v.stride()),
                                   dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return [_meta(e) for e in v]
    if isinstance(v, torch.SymInt):
        return _hint(v, 64)
    return v


_NO_WORK = {"gemm_flops": 0.0, "elem": 0.0, "transcendental": 0.0, "bytes": 0.0}


def node_work(node: torch.fx.Node) -> dict:
    """gemm_flops, elem (elementwise outputs), transcendental, bytes of one
    op, from the engine's cost model (plan::estimate_op_work: the rules it
    prices recorded ops by; views are free)."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return dict(_NO_WORK)
    schema = t._schema
    args = []
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            v = node.args[i]
        elif a.name in node.kwargs:
            v = node.kwargs[a.name]
        else:
            v = a.default_value if a.has_default_value() else None
        args.append(_meta(v))
    outputs = [_meta(v) for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
    return _C._op_work(schema.name, schema.overload_name, args, outputs)


def seconds(w: dict, lanes: int) -> float:
    """What `w` costs on one of `lanes` lanes when all of them run."""
    return _C._work_seconds(w, lanes) if any(w.values()) else 0.0


class _Groups:
    """Union of FX nodes into groups, with the group graph kept current."""

    def __init__(self, nodes, cost):
        self.of = {}
        self.members = {}
        self.cost = {}
        for n in nodes:
            g = self.of.get(n.args[0]) if n.target is operator.getitem and n.args[0] in self.of else None
            if g is None:
                g = len(self.members)
                self.members[g] = []
                self.cost[g] = 0.0
            self.of[n] = g
            self.members[g].append(n)
            self.cost[g] += cost[n]
        self.preds = {g: set() for g in self.members}
        self.succs = {g: set() for g in self.members}
        for n in nodes:
            for i in n.all_input_nodes:
                a, b = self.of.get(i), self.of[n]
                if a is not None and a != b:
                    self.preds[b].add(a)
                    self.succs[a].add(b)

    def reaches(self, a, b, skip_direct=False) -> bool:
        """Is there a path a -> ... -> b (of two or more edges if skip_direct)?"""
        stack = [s for s in self.succs[a] if not (skip_direct and s == b)]
        seen = set(stack)
        while stack:
            g = stack.pop()
            if g == b:
                return True
            for s in self.succs[g]:
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return False

    def can_merge(self, a, b) -> bool:
        if b in self.succs[a]:
            return not self.reaches(a, b, skip_direct=True)
        if a in self.succs[b]:
            return not self.reaches(b, a, skip_direct=True)
        return not self.reaches(a, b) and not self.reaches(b, a)

    def merge(self, keep, gone):
        for n in self.members[gone]:
            self.of[n] = keep
        self.members[keep] += self.members.pop(gone)
        self.cost[keep] += self.cost.pop(gone)
        for p in self.preds.pop(gone):
            self.succs[p].discard(gone)
            if p != keep:
                self.succs[p].add(keep)
                self.preds[keep].add(p)
        for s in self.succs.pop(gone):
            self.preds[s].discard(gone)
            if s != keep:
                self.preds[s].add(keep)
                self.succs[keep].add(s)
        self.preds[keep].discard(keep)
        self.succs[keep].discard(keep)

    def contract_chains(self):
        changed = True
        while changed:
            changed = False
            for g in list(self.members):
                if g not in self.members or len(self.succs[g]) != 1:
                    continue
                (s,) = self.succs[g]
                if len(self.preds[s]) == 1:
                    self.merge(g, s)
                    changed = True

    def merge_small(self, small):
        changed = True
        while changed:
            changed = False
            for g in sorted(self.members, key=lambda k: self.cost[k]):
                if g not in self.members or self.cost[g] >= small or len(self.members) == 1:
                    continue
                # Into its only predecessor (whose other readers wait for it
                # a little longer: it stays in the parallel part), else its
                # only successor (which waits for it anyway, but may be a
                # join: the work moves after the join), else the cheapest
                # successor: never into one of several predecessors, which
                # would then wait for the rest.
                if len(self.preds[g]) == 1:
                    target = next(iter(self.preds[g]))
                elif len(self.succs[g]) == 1:
                    target = next(iter(self.succs[g]))
                elif not self.preds[g] and not self.succs[g]:
                    # An island (a counter's update): into the cheapest group.
                    target = min((k for k in self.members if k != g), key=lambda k: self.cost[k])
                else:
                    options = sorted(self.succs[g], key=lambda k: self.cost[k])
                    target = next((o for o in options if self.can_merge(g, o)), None)
                if target is None or not self.can_merge(g, target):
                    continue
                self.merge(target, g)
                self.contract_chains()
                changed = True
                break

    def order(self):
        """Groups in a topological order (by their first member's position)."""
        indeg = {g: len(self.preds[g]) for g in self.members}
        first = {g: min(self._pos[n] for n in self.members[g]) for g in self.members}
        ready = sorted((g for g, d in indeg.items() if d == 0), key=first.get)
        out = []
        while ready:
            g = ready.pop(0)
            out.append(g)
            for s in self.succs[g]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    ready.append(s)
            ready.sort(key=first.get)
        assert len(out) == len(self.members), "partition graph has a cycle"
        return out


def _makespan(groups, order, lanes):
    """The groups run as partitions over `lanes` lanes, list-scheduled as
    the engine schedules (each paying a partition's call)."""
    index = {g: k for k, g in enumerate(order)}
    return _C._partition_makespan([groups.cost[g] for g in order],
                                  [sorted(index[p] for p in groups.preds[g]) for g in order], lanes)


def split(gm: torch.fx.GraphModule, lanes: int):
    """Groups of `gm`'s compute nodes (lists in graph order), in an order
    that runs each after the groups it reads from."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
    if not nodes:
        return []
    cost = {n: seconds(node_work(n), lanes) for n in nodes}
    groups = _Groups(nodes, cost)
    groups._pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    call_s = _C._cost_model()["partition_call_s"]
    if lanes > 1 and len(groups.members) > 1:
        groups.contract_chains()
        # Small: not worth a partition's call, or a sliver of the whole graph.
        groups.merge_small(max(call_s, sum(groups.cost.values()) / (16 * lanes)))
        groups.contract_chains()
    order = groups.order()
    serial = sum(groups.cost.values()) + call_s
    if lanes < 2 or len(order) < 2 or _makespan(groups, order, lanes) * MIN_GAIN > serial:
        return [[n for n in gm.graph.nodes if n in groups.of]]
    pos = groups._pos
    return [sorted(groups.members[g], key=pos.get) for g in order]


def subgraph(gm: torch.fx.GraphModule, members, outputs_used_outside):
    """A GraphModule computing `members` (nodes of `gm`): its placeholders are
    the values it reads from elsewhere (returned as `inputs`, FX nodes of
    `gm`), its outputs the members read elsewhere (`outputs`)."""
    inside = set(members)
    inputs, outputs = [], []
    for n in members:
        for i in n.all_input_nodes:
            if i not in inside and i not in inputs:
                inputs.append(i)
    for n in members:
        if n in outputs_used_outside:
            outputs.append(n)
    g = torch.fx.Graph()
    env = {}
    for i in inputs:
        p = g.placeholder(i.name)
        p.meta = dict(i.meta)
        env[i] = p
    for n in members:
        env[n] = g.node_copy(n, lambda x: env[x])
    out = g.output(tuple(env[o] for o in outputs))
    out.meta["user_visible_output_idxs"] = list(range(len(outputs)))
    sub = torch.fx.GraphModule(gm, g)
    return sub, inputs, outputs


def used_outside(gm, groups):
    """Nodes read by another group or by the graph's output."""
    group_of = {n: k for k, members in enumerate(groups) for n in members}
    used = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            used.update(n.all_input_nodes)
            continue
        k = group_of.get(n)
        for i in n.all_input_nodes:
            if i in group_of and group_of[i] != k:
                used.add(i)
    return used
