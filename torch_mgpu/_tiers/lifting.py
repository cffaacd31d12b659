"""Floating constants that vary between runs lifted into inputs of the traced
graph (lift), so that a new learning rate does not mean a new compile."""
import torch

from .replay import replay_fn


# Floating constants are traced twice with stand-ins (two sets of values no
# program has); where the two traces differ only by the stand-ins, a
# constant's uses are literals of the traced graph that become inputs.
_STAND_INS = (0.7071067811865476, 0.31622776601683794)


def _stand_in(which, j):
    return _STAND_INS[which] * (1.0 + j * 2.0 ** -20)


def lift_candidates(req):
    """(node, argument) of every floating constant whose value changed
    between the runs that made the graph hot: learning rates, Adam's step
    sizes, a schedule's factors, Python numbers in `x * lr`. The others are
    compiled in (and folded)."""
    varying = {tuple(v) for v in req.get("varying", ())}
    out = []
    for i, node in enumerate(req["nodes"]):
        for k, (_, _, kind, value) in enumerate(node["args"]):
            if kind != "c" or (i, k) not in varying:
                continue
            if (isinstance(value, float) or (isinstance(value, torch.Tensor) and value.dim() == 0
                                              and value.dtype.is_floating_point)):
                out.append((i, k))
    return out


def _trace(req, subst, examples):
    from torch.fx.experimental.proxy_tensor import make_fx

    # Decomposed, so that a Scalar argument (addcdiv_'s value) becomes a
    # tensor operand (a mul's) that an input can take the place of.
    return make_fx(replay_fn(req, subst), tracing_mode="fake", decomposition_table=_decompositions())(*examples)


def _decompositions():
    """The core ATen decompositions, less those whose results are not the
    op's: flash attention for the CPU decomposes (for export) into the math
    form, whose second result is the attention weights where the op returns
    their log-sum-exp, which its backward reads (inductor leaves it out too:
    it runs the op's own kernel). Integer matrix products decompose into a
    sum of products in their own dtype (_integer_products)."""
    from torch._decomp import core_aten_decompositions

    table = core_aten_decompositions()
    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,):
        table.pop(op, None)
    table.update(_integer_products())
    return table


def _integer_products():
    """Integer mm, bmm, addmm and baddbmm as a sum of products in the
    operands' dtype, which inductor compiles as one loop. Inductor's own CPU
    decomposition of a product with one row or one column sums the products
    in int64 and returns int64 (a uint8 `bmm` over 1x3x3 and 1x3x1 gave
    an int64 tensor that fits no uint8 value). Sums that wrap give eager's
    values: integer arithmetic wraps alike in any width it is then cast
    from. Floating and complex products are left to their kernels."""
    aten = torch.ops.aten

    def integer(*ts):
        return all(not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool) for t in ts)

    def product(a, b):
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2, dtype=a.dtype)

    def mm(a, b):
        return product(a, b) if integer(a, b) and a.dtype == b.dtype else NotImplemented

    def added(self, a, b, beta=1, alpha=1):
        if not (integer(self, a, b) and a.dtype == b.dtype == self.dtype):
            return NotImplemented
        out = product(a, b)
        if alpha != 1:
            out = out * alpha
        return out if beta == 0 else out + (self if beta == 1 else self * beta)

    return {aten.mm.default: mm, aten.bmm.default: mm, aten.addmm.default: added, aten.baddbmm.default: added}


def _literals(node):
    """The node's arguments flattened, each with whether an input tensor
    may take its place (a number passed straight to a Tensor argument)."""
    from torch.utils._pytree import tree_flatten

    schema = getattr(node.target, "_schema", None)
    types = {}
    if schema is not None:
        for k, a in enumerate(schema.arguments):
            types[k] = types[a.name] = str(a.type)
    out = []
    for key, value in list(enumerate(node.args)) + list(node.kwargs.items()):
        flat, _ = tree_flatten(value)
        direct = len(flat) == 1 and flat[0] is value
        for x in flat:
            out.append((x, direct and types.get(key) in ("Tensor", "Optional[Tensor]")))
    return out


def _uses(traced, count):
    """Where each stand-in is used in the first of `traced` (graphs of one
    replay with stand-ins of two kinds, and with the real constants): None
    when they differ otherwise (a constant used through arithmetic, or one
    that changes the graph's shape), else j -> [(node, flat position,
    whether a tensor may take its place)]."""
    nodes = [list(gm.graph.nodes) for gm in traced]
    if len({len(n) for n in nodes}) != 1:
        return None
    uses = {j: [] for j in range(count)}
    for row in zip(*nodes):
        if len({(n.op, n.target) for n in row}) != 1:
            return None
        lits = [_literals(n) for n in row]
        if len({len(l) for l in lits}) != 1:
            return None
        for pos, ((x, ok), (y, _)) in enumerate(zip(lits[0], lits[1])):
            if isinstance(x, torch.fx.Node) or x == y:
                continue
            js = [j for j in range(count) if x == _stand_in(0, j) and y == _stand_in(1, j)]
            if not js or not isinstance(x, float):
                return None
            uses[js[0]].append((row[0], pos, ok))
    return uses


def lift(req, examples):
    """(graph module, lifted (node, argument) list): the floating constants
    that became inputs (0-dim float64 tensors after the leaves, in the
    list's order), the others baked in. A constant is lifted when each of
    its uses in the traced graph is a number passed to a Tensor argument
    (decompositions turn addcdiv_'s value into a mul's operand), and the
    graph has the same shape whatever its values (traced with two sets of
    stand-ins and with the real values)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.utils._pytree import tree_flatten, tree_unflatten

    cands = lift_candidates(req)
    real = _trace(req, {}, examples)
    if not cands:
        return real, []

    def pair(js):
        return [_trace(req, {cands[j]: _stand_in(w, j) for j in js}, examples) for w in (0, 1)]

    keep = list(range(len(cands)))
    traced = pair(keep)
    uses = _uses(traced + [real], len(cands))
    if uses is None:
        return real, []
    keep = [j for j in keep if uses[j] and all(ok for _, _, ok in uses[j])]
    if not keep:
        return real, []
    if len(keep) < len(cands):
        traced = pair(keep)
        uses = _uses(traced + [real], len(cands))
        if uses is None or any(not ok for j in keep for _, _, ok in uses[j]) or not all(uses[j] for j in keep):
            return real, []
    gm = traced[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        created = [gm.graph.placeholder(f"lifted_{j}") for j in reversed(keep)]
    inputs = dict(zip(reversed(keep), created))
    before = {n: n.meta.get("val") for n in gm.graph.nodes}
    for j in keep:
        for node, pos, _ in uses[j]:
            flat, spec = tree_flatten((node.args, node.kwargs))
            flat[pos] = inputs[j]
            node.args, node.kwargs = tree_unflatten(flat, spec)
    gm.graph.lint()
    gm.recompile()
    # Another result dtype (an integer tensor times a float64 tensor is
    # float64, times a Python float the default dtype): keep them baked in.
    try:
        device = examples[0].device if examples else None
        FakeTensorProp(gm).propagate(*examples, *[torch.tensor(_stand_in(0, j), dtype=torch.float64, device=device)
                                                  for j in keep])
    except Exception:
        return real, []
    for n, old in before.items():
        new = n.meta.get("val")
        if isinstance(old, torch.Tensor) and (not isinstance(new, torch.Tensor) or new.dtype != old.dtype
                                              or new.shape != old.shape):
            return real, []
    return gm, [cands[j] for j in keep]
