"""Tier 1's shared pieces: the exception that leaves a graph to tier 0, and
the ops a recorded node calls."""
import torch


class Unsupported(Exception):
    """A graph tier 1 does not take; it stays in tier 0."""


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
    for k, (_, _, (kind, value)) in enumerate(node["args"]):
        if (kind == "c" and type(value) in (bool, int, float, complex) and k < len(schema)
                and isinstance(schema[k].type, torch.TensorType)):
            ns, _, name = node["op"].partition("::")
            return getattr(getattr(torch.ops, ns), name)
    return op
