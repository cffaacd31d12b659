"""Splits an ATen FX graph into partitions along its independent branches.

Used by the torch.compile backend (`compile.py`): each partition is
compiled by inductor on its own and runs as one node of the lazy engine, so
independent partitions run side by side on the lanes.

The split is the engine's (plan/groups.h, shared with tier 1 of the lazy
path): chains contracted, groups too small to pay for a partition's call
merged into a neighbour, and the groups kept only if list scheduling them
over the lanes (each paying a partition's call) beats running the graph as
one piece. Here the graph's ops are priced by the engine's model
(plan/topology.h's estimate_op_work and node_seconds), so the split and the
plan agree.
"""
import operator

import torch
import torch.fx
from torch.fx.experimental import symbolic_shapes
from torch.utils._pytree import tree_flatten

from . import _C


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


def split(gm: torch.fx.GraphModule, lanes: int):
    """Groups of `gm`'s compute nodes (lists in graph order), in an order
    that runs each after the groups it reads from: the engine's grouping
    and its decision whether the groups beat one piece (`_C._split_groups`,
    plan/groups.h), over the ops priced by the engine's model. A `getitem`
    belongs to the op it reads."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
    if not nodes:
        return []
    units, unit_of = [], {}
    for n in nodes:
        src = n.args[0] if n.target is operator.getitem else None
        if src is not None and src in unit_of:
            unit_of[n] = unit_of[src]
            units[unit_of[n]].append(n)
        else:
            unit_of[n] = len(units)
            units.append([n])
    cost = [sum(seconds(node_work(n), lanes) for n in members) for members in units]
    preds = [sorted({unit_of[i] for n in members for i in n.all_input_nodes if i in unit_of} - {k})
             for k, members in enumerate(units)]
    groups = _C._split_groups(cost, preds, lanes)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted((n for u in g for n in units[u]), key=pos.get) for g in groups]


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
