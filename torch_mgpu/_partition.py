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
import heapq
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
        home = _home(n, unit_of)
        if home is not None:
            if n.target is torch.ops.higher_order.with_effects and unit_of[n.args[0]] != home:
                # Its token (made just before it, alone) comes along.
                units[unit_of[n.args[0]]].remove(n.args[0])
                unit_of[n.args[0]] = home
                units[home].append(n.args[0])
            unit_of[n] = home
            units[home].append(n)
        else:
            unit_of[n] = len(units)
            units.append([n])
    units = _in_dependency_order([m for m in units if m], unit_of)
    unit_of = {n: k for k, members in enumerate(units) for n in members}
    cost = [sum(seconds(node_work(n), lanes) for n in members) for members in units]
    preds = [sorted({unit_of[i] for n in members for i in n.all_input_nodes if i in unit_of} - {k})
             for k, members in enumerate(units)]
    groups = _C._split_groups(cost, preds, lanes)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted((n for u in g for n in units[u]), key=pos.get) for g in groups]


def _home(n, unit_of):
    """The unit `n` joins (None: a unit of its own). A `getitem` joins the
    op it reads; an effectful call (`with_effects`, after untie_effects)
    joins the op whose value it reads, and its token's sink joins it."""
    if n.target is operator.getitem and n.args[0] in unit_of:
        return unit_of[n.args[0]]
    if n.target is torch.ops.higher_order.with_effects:
        for i in n.all_input_nodes[1:]:
            if i in unit_of:
                return unit_of[i]
        return unit_of.get(n.args[0])
    if n.target is torch.ops.prims._sink_tokens.default and n.all_input_nodes:
        return unit_of.get(n.all_input_nodes[0])
    return None


def _in_dependency_order(units, unit_of):
    """`units` ordered so that each comes after those it reads (graph order
    where free): an effectful call joins a unit that may come before what
    else it reads."""
    at = {n: k for k, members in enumerate(units) for n in members}
    preds = [{at[i] for n in members for i in n.all_input_nodes if i in at} - {k} for k, members in enumerate(units)]
    if all(all(p < k for p in ps) for k, ps in enumerate(preds)):
        return units
    waiting = [len(ps) for ps in preds]
    readers = [[] for _ in units]
    for k, ps in enumerate(preds):
        for p in ps:
            readers[p].append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:  # the first unit in graph order whose inputs are all made
        k = heapq.heappop(ready)
        order.append(units[k])
        for r in readers[k]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    assert len(order) == len(units), "partition units read each other in a cycle"
    return order


def untie_effects(gm: torch.fx.GraphModule) -> None:
    """Gives each effectful call its own token: AOTAutograd threads one
    token through them all (made at the start, sunk at the end), which
    would tie every branch that checks a Cholesky (`_linalg_check_errors`)
    to the others, and a partition returning a token fails in inductor
    ("'NoneType' object has no attribute 'get_size'"). Each call's token is
    made just before it and sunk just after it: the checks still run, each
    with its branch, in no order between branches."""
    g = gm.graph
    effects = [n for n in g.nodes if n.target is torch.ops.higher_order.with_effects]
    if not effects:
        return
    made = [n for n in g.nodes if n.target is torch.ops.prims._make_token.default]
    for n in [n for n in g.nodes if n.target is torch.ops.prims._sink_tokens.default]:
        g.erase_node(n)
    position = {n: k for k, n in enumerate(g.nodes)}
    for e in effects:
        with g.inserting_before(e):
            token = g.call_function(torch.ops.prims._make_token.default, ())
        token.meta = dict(made[0].meta) if made else {"val": torch.empty(0)}
        e.args = (token,) + tuple(e.args[1:])
        outs = [u for u in e.users if u.target is operator.getitem and u.args[1] == 0]
        if outs:
            out = outs[0]
        else:
            with g.inserting_after(e):
                out = g.call_function(operator.getitem, (e, 0))
            out.meta = {"val": token.meta.get("val")}
        # `out` is the only user made here, right after `e`: any other comes later.
        later = [u for u in e.users if u in position]
        last = max(later, key=position.__getitem__) if later else out
        with g.inserting_after(last):
            g.call_function(torch.ops.prims._sink_tokens.default, ([out],)).meta = {"val": None}
    for n in made:
        if not n.users:
            g.erase_node(n)
    g.lint()
    gm.recompile()


def subgraph(gm: torch.fx.GraphModule, members, outputs_used_outside, visible=None, whole=False):
    """A GraphModule computing `members` (nodes of `gm`): its placeholders are
    the values it reads from elsewhere (returned as `inputs`, FX nodes of
    `gm`), its outputs the members read elsewhere (`outputs`). Outputs in
    `visible` (all, where it is None) keep their eager strides: inductor
    lays out the others as it likes (a saved activation channels-last).
    `whole`: the graph's inputs that it returns are outputs too (inductor
    returns an input saved for the backward in its own layout)."""
    inside = set(members)
    inputs, outputs = [], []
    for n in members:
        for i in n.all_input_nodes:
            if i not in inside and i not in inputs:
                inputs.append(i)
    for n in members:
        if n in outputs_used_outside:
            outputs.append(n)
    if whole:
        for n in gm.graph.nodes:
            if n.op == "placeholder" and n in outputs_used_outside:
                if n not in inputs:
                    inputs.append(n)
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
    out.meta["user_visible_output_idxs"] = [k for k, o in enumerate(outputs) if visible is None or o in visible]
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
