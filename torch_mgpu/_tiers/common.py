"""Tier 1's shared pieces: the exception that leaves a graph to tier 0, the
request's records as named tuples, and the ops a recorded node calls."""
from typing import NamedTuple

import torch


class Unsupported(Exception):
    """A graph tier 1 does not take; it stays in tier 0."""


def is_contiguous(sizes, strides):
    """Whether sizes and strides are contiguous as torch's is_contiguous()
    says (sizes of 1 and empty tensors take any stride)."""
    expected = 1
    for size, stride in reversed(list(zip(sizes, strides))):
        if size == 0:
            return True
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class Geometry(NamedTuple):
    """Where a tensor lies in its storage, in elements, and its dtype."""
    sizes: list
    strides: list
    offset: int
    dtype: torch.dtype


class Ref(NamedTuple):
    """A tensor argument: a view of the node's operand number `operand`
    (an index into node["operands"]) with geometry `geom`; `same`: the
    number of a tensor passed at more than one place (`topk(x, 2, out=(x,
    i))`), which is one tensor at each of them, -1 for one passed once."""
    operand: int
    geom: Geometry
    same: int


class Arg(NamedTuple):
    """One argument of a recorded call, in the schema's order: its name,
    whether it is keyword-only, its kind ("c" a constant, "t" a tensor, "l"
    a tensor list) and its value (the constant as Python passes it; a Ref,
    or None for an undefined tensor; a list of those)."""
    name: str
    kwarg_only: bool
    kind: str
    value: object


class Output(NamedTuple):
    """A value a node makes: its number, the operand it writes in place
    (-1: a fresh output), a fresh output's place among the op's returns
    flattened, its storage's size in bytes (a written one's: after the
    write) and a fresh output's geometry."""
    value: int
    mutated: int
    returned: int
    nbytes: int
    geom: Geometry


class Written(NamedTuple):
    """A tensor argument the op writes: the argument's index, its place in
    a tensor list (-1 for a plain tensor), and the tensor's geometry after
    the call (an out= tensor the op resizes)."""
    arg: int
    element: int
    after: Geometry


def records(req):
    """The request as the engine sends it (csrc/python/tiers.cpp: dicts,
    the nodes' records as plain tuples), its records as the named tuples
    above: each node's args as Arg (a tensor's ref as Ref, its geometry as
    Geometry), outputs as Output, written as Written; its parts likewise."""
    def ref(r):
        return None if r is None else Ref(r[0], Geometry(*r[1]), r[2])

    def arg(a):
        name, kwarg_only, (kind, value) = a
        if kind == "t":
            value = ref(value)
        elif kind == "l":
            value = [ref(r) for r in value]
        return Arg(name, kwarg_only, kind, value)

    def node(n):
        out = dict(n, args=[arg(a) for a in n["args"]],
                   outputs=[Output(v, m, r, nbytes, Geometry(*g)) for v, m, r, nbytes, g in n["outputs"]])
        if "written" in n:
            out["written"] = [Written(a, e, Geometry(*after)) for a, e, after in n["written"]]
        return out

    out = dict(req, nodes=[node(n) for n in req["nodes"]])
    if "parts" in req:
        out["parts"] = [records(p) for p in req["parts"]]
    return out


def _op(name, overload):
    ns, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, ns), op)
    return getattr(packet, overload or "default")


def _op_for_args(node):
    """The op a recorded node calls: its overload, or where a number stands
    for a Tensor argument (a wrapped number: `x.remainder(0.7)` records
    remainder.Tensor with 0.7) the overload packet, which picks the
    overload that takes the number as the Python call did (a 0-dim tensor
    in its place would promote otherwise: an integer tensor with a float64
    one is float64, with a Python float the default dtype)."""
    op = _op(node["op"], node["overload"])
    schema = op._schema.arguments
    for k, (_, _, kind, value) in enumerate(node["args"]):
        if (kind == "c" and type(value) in (bool, int, float, complex) and k < len(schema)
                and isinstance(schema[k].type, torch.TensorType)):
            ns, _, name = node["op"].partition("::")
            return getattr(getattr(torch.ops, ns), name)
    return op
