"""Tier 1 of the lazy path: hot graphs compiled in the background.

The engine (csrc/engine/tiers.h) counts the syncs of each graph (its
structure and its constants). Once a graph has run `compile_hits` times node
by node, it is queued here: a daemon thread turns it into one inductor
function and hands it back, and the engine runs that function for later
syncs of the graph when it measures faster than the node-by-node run.
A graph with independent branches also comes split into parts (the
torch.compile backend's split, made by the engine): each part is compiled
on its own with the C++ wrapper (which lets go of the GIL), and the engine
runs them side by side on the lanes; it times both ways and keeps the
faster.

A graph reaches this file as plain data: its leaves (storages it reads, by
size), its nodes (op, arguments, which values they read and write) and its
roots (values the sync needs). It is replayed here as a function of the
leaves' bytes, traced with make_fx into an ATen graph and compiled with
inductor's `compile_fx`. The function is pure: a node that writes in place
writes a copy of what it writes (the copy is free after inductor's passes
where nothing reads the old bytes), so that a compiled run that fails can
run again node by node.

FX tracing keeps process-wide state (`torch.fx._symbolic_trace`'s tracing
flag and patcher), which torch.compile on another thread reads and writes:
the thread compiles while holding dynamo's compile lock (no frame compiles
beside it), and while it traces, calls of functions torch.compile already
compiled run their compiled code instead of refusing ("Detected that you
are using FX to symbolically trace a dynamo-optimized function").
"""
import contextlib
import functools
import math
import struct
import threading
import time

import torch

from . import _C

_thread = None
_lock = threading.Lock()


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


def _flat_dtypes(req):
    """The dtype each leaf is read as (one per leaf)."""
    dtypes = [None] * len(req["leaves"])
    for node in req["nodes"]:
        for _, _, (kind, value) in node["args"]:
            refs = [value] if kind == "t" else value if kind == "l" else []
            for r in refs:
                if r is None:
                    continue
                v = node["operands"][r[0]]
                if v < len(dtypes):
                    dt = r[1][3]
                    if dtypes[v] is not None and dtypes[v] != dt:
                        raise Unsupported("a storage read as two dtypes")
                    dtypes[v] = dt
    return [d if d is not None else torch.uint8 for d in dtypes]


def _contiguous(sizes, strides):
    expected = 1
    for d, st in zip(reversed(sizes), reversed(strides)):
        if d != 1 and st != expected:
            return False
        expected *= d
    return True


def _strided_read(flat, sizes, strides, offset):
    """The elements of the 1-D tensor `flat` that the geometry places, for
    a buffer the graph makes (not one of its inputs). Inductor's code for
    an as_strided view of such a buffer may read it after a later write
    into its bytes (a copy of it that reuses them): difffuzz seed 3811486,
    `y = x.repeat_interleave(2); x[:] = z` gave y z's values. A geometry
    that is a slice of the bytes, split into dims (and narrowed, for gaps
    between rows), permuted and expanded (stride 0) is read as those
    views; others by an index computed from the strides (a gather)."""
    dims = [d for d in range(len(sizes)) if sizes[d] != 1 and strides[d] != 0]
    order = sorted(dims, key=lambda d: -strides[d])
    numel = 1
    for d in sizes:
        numel *= d

    def placed(t):
        # `t` holds the dims of `order`, in that order: back to the
        # geometry's order of dims, then its size-1 and expanded ones.
        inverse = sorted(range(len(order)), key=lambda k: order[k])
        t = t.permute(inverse) if order else t.reshape(())
        shape = [1] * len(sizes)
        for d in order:
            shape[d] = sizes[d]
        return t.reshape(shape).expand(sizes)

    step = strides[order[-1]] if order else 1
    pairs = list(zip(order, order[1:]))
    if step > 0 and numel > 0 and all(strides[a] == strides[b] * sizes[b] for a, b in pairs):
        # A slice of the bytes (every `step`-th element), split into dims.
        span = 1 + sum((sizes[d] - 1) * strides[d] for d in order)
        if offset + span <= flat.numel():
            return placed(flat[offset:offset + span:step].view([sizes[d] for d in order]))
    if step > 0 and numel > 0 and order and all(
            strides[a] % strides[b] == 0 and strides[a] // strides[b] >= sizes[b] for a, b in pairs):
        # Rows with gaps between them (columns of a matrix): the slice
        # padded to whole rows, split into dims, then narrowed.
        length = sizes[order[0]] * strides[order[0]]
        if offset + length <= flat.numel():
            padded = [sizes[order[0]]] + [strides[a] // strides[b] for a, b in pairs]
            t = flat[offset:offset + length:step].view(padded)
            for k, d in enumerate(order[1:], 1):
                t = t.narrow(k, 0, sizes[d])
            return placed(t)
    index = offset
    for d, (n, st) in enumerate(zip(sizes, strides)):
        shape = [1] * len(sizes)
        shape[d] = n
        index = index + torch.arange(n, device=flat.device).view(shape) * st
    return flat[index]


def _permutation(fresh, geom):
    """The order of `fresh`'s dims that `geom` is (a transpose or permute
    of it: the same offset, each dim one of fresh's with its size and
    stride), or None. Dims of size 1 match any stride: where they go does
    not change which element is where."""
    fsizes, fstrides, foffset = fresh
    sizes, strides, offset = geom
    if offset != foffset or len(sizes) != len(fsizes):
        return None
    perm, used = [], set()
    for d, st in zip(sizes, strides):
        j = next((j for j in range(len(fsizes)) if j not in used and fsizes[j] == d and (d == 1 or fstrides[j] == st)),
                 None)
        if j is None:
            return None
        used.add(j)
        perm.append(j)
    return perm


# Ops whose CPU kernel rounds a Python number operand to a half or
# bfloat16 tensor's dtype before it computes (in float32), where inductor
# keeps the number as a float32 constant: `x + 2.7856` in bfloat16 adds
# 2.78125 in eager (difffuzz seed 3750665: 0.0469 against 0.0513 after
# cancellation). Measured op by op; mul, div, clamp, lerp, addcmul,
# where, fill and the activations keep the number and agree as they are.
_ROUNDS_NUMBER_TO_DTYPE = {"aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::rsub", "aten::pow",
                           "aten::pow_", "aten::remainder", "aten::remainder_", "aten::fmod", "aten::fmod_"}
_REDUCED_FLOATS = (torch.float16, torch.bfloat16)


def _result_dtypes(node):
    """The dtypes of a recorded node's fresh outputs and written tensors."""
    return [o[4][3] for o in node["outputs"] if o[1] < 0] + [w[2][3] for w in node.get("written", ())]


def _compute_dtype(node):
    """The dtype a binary op computes in: the result type of its first two
    arguments (self, other) as the call promoted them (a tensor's dtype,
    0-dim or not, a number's kind), not the dtype it writes (an out= or
    in-place tensor of another dtype is cast to at the end). None where
    they are not a tensor and a number or two tensors."""
    vals = []
    for _, _, (kind, value) in node["args"][:2]:
        if kind == "t" and value is not None:
            sizes, dtype = value[1][0], value[1][3]
            vals.append(torch.empty([1] * len(sizes), dtype=dtype))
        elif kind == "c" and type(value) in (bool, int, float, complex):
            vals.append(value)
        elif kind == "c" and isinstance(value, torch.Tensor) and value.dim() == 0:
            vals.append(value)
        else:
            return None
    if len(vals) != 2 or not any(isinstance(v, torch.Tensor) for v in vals):
        return None
    return torch.result_type(*vals)


def _number_rounding(nodes):
    """node index -> the floating dtype its number operands are rounded to,
    for the nodes where eager rounds them: those of _ROUNDS_NUMBER_TO_DTYPE
    that compute in half or bfloat16, and the float32 nodes replayed by
    eager's multiply-add formulas (see _fma_formula)."""
    out = {}
    for i, n in enumerate(nodes):
        if n["op"] in _ROUNDS_NUMBER_TO_DTYPE:
            dt = _compute_dtype(n)
            if dt in _REDUCED_FLOATS:
                out[i] = dt
        if i not in out and _fma_formula(n) is not None:
            out[i] = torch.float32  # eager's float32 kernel takes its Scalars in float32
    return out


def _rounded(value, dtype):
    """A number argument as `dtype` holds it: a Python int or float as a
    float, a number wrapped as a 0-dim tensor (`x.remainder(0.7)` records
    remainder.Tensor) as such a tensor of its own dtype; anything else as
    it is."""
    if type(value) in (int, float):
        return float(torch.tensor(value, dtype=torch.float64).to(dtype))
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
        return value.to(dtype).to(value.dtype)
    return value


def _eager_remainder(a, b):
    """Eager's CPU remainder of floating a by b (fmod, then b added where
    the signs differ): inductor's a - floor(a / b) * b gives NaN for an
    infinite b (0 % inf: 0 - 0 * inf), where eager gives a (difffuzz seed
    3750026)."""
    m = torch.fmod(a, b)
    return torch.where((m != 0) & ((m < 0) != (b < 0)), m + b, m)


def _eager_floor_divide(a, b):
    """Eager's CPU floor division of floating a by b (c10::div_floor_floating):
    inductor's floor(a / b) gives -0.0 for 1.59 // -inf, where eager (and
    Python) gives -1 (difffuzz seed 3750483)."""
    if not isinstance(b, torch.Tensor) and b == 0:
        return a / b
    mod = torch.fmod(a, b)
    div = (a - mod) / b
    div = torch.where((mod != 0) & ((mod < 0) != (b < 0)), div - 1, div)
    floor = torch.floor(div)
    floor = torch.where(div - floor > 0.5, floor + 1, floor)
    quotient = a / b
    out = torch.where(div != 0, floor, torch.copysign(torch.zeros_like(div), quotient))
    # A finite a over a b so small that the quotient overflows: eager's
    # exact fmod leaves a, so it is a / b, infinite. Inductor's fmod is NaN
    # there (difffuzz seed 3811374: 1 // 1.4e-45).
    out = torch.where(torch.isinf(quotient) & torch.isfinite(a), quotient, out)
    return torch.where(b == 0, quotient, out) if isinstance(b, torch.Tensor) else out


def _accurate_erf(x):
    """erf of a float32 tensor as eager computes it, within a few units in
    the last place: inductor's vectorized erf is an approximation with an
    absolute error of about 1e-7, 4.5e-4 relative near 0 (difffuzz seed
    3760451: 1 / erf(x)^2 off by 1.8e-4). Near 0 its Taylor series (the
    first term left out is below 1e-12 relative for |x| < 1/8)."""
    x2 = x * x
    series = x * (1.1283791670955126 + x2 * (-0.37612638903183754 + x2 * (
        0.11283791670955126 + x2 * (-0.026866170645131252 + x2 * 0.005223977625442188))))
    return torch.where(x.abs() < 0.125, series, torch.erf(x))


def _unary_formula(node):
    """For a float32 erf (erf_, erf.out): _accurate_erf; else None."""
    if node["op"] not in ("aten::erf", "aten::erf_") or node["args"][0][2][0] != "t":
        return None
    if node["args"][0][2][1][1][3] != torch.float32:
        return None
    return lambda a, b=None: _accurate_erf(a)


# Reductions whose CPU kernel, given an out= of another dtype and no dtype
# argument, casts the input to out='s dtype and reduces in it.
_REDUCES_IN_OUT_DTYPE = frozenset(f"aten::{n}" for n in ("sum", "nansum", "mean", "prod", "cumsum", "cumprod"))


def _float32_bmm(dtype, a, b):
    """A half or bfloat16 batched product as eager's CPU kernel computes
    it: the products and their sum in float32, rounded once. Inductor's CPU
    lowering turns a bmm with one row or one column into a sum of products,
    and with precision casts emulated each product is rounded to the dtype
    first (difffuzz seed 3780045: einsum('ij,jk->ik') of a (1, 2) and a
    (2, 2) float16, one unit in the last place off)."""
    return torch.bmm(a.to(torch.float32), b.to(torch.float32)).to(dtype)


def _half_bmm_formula(node):
    """_float32_bmm for a half or bfloat16 bmm that inductor computes as a
    sum of products (one row or one column) and eager's CPU kernel as
    float32 sums (its plain loop: fewer than 400 multiply-adds). Larger
    products with one row or column go another way in eager (a BLAS) that
    neither matches: the graph is not compiled. Other products: None
    (inductor calls eager's own kernel)."""
    if node["overload"] not in ("", "out"):
        return None  # bmm.dtype: the result in another dtype
    a, b = (node["args"][k][2] for k in range(2))
    if a[0] != "t" or b[0] != "t" or a[1] is None or b[1] is None:
        return None
    dt = a[1][1][3]
    if dt not in _REDUCED_FLOATS:
        return None
    (_, m, k), (_, _, n) = a[1][1][0], b[1][1][0]
    if m != 1 and n != 1:
        return None
    if k * m * n >= 400:
        raise Unsupported("a half or bfloat16 bmm with one row or column of 400 or more products")
    return functools.partial(_float32_bmm, dt)


def _float32_number(v):
    """A number (or a lifted number's 0-dim tensor) as float32 holds it, as a
    float or a float32 tensor: eager's kernel takes a Scalar in float32
    arithmetic (opmath) for float32 tensors."""
    if isinstance(v, torch.Tensor):
        return v.to(torch.float32)
    try:
        return struct.unpack("f", struct.pack("f", float(v)))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _fma(x, y, z):
    """x * y + z of float32 values rounded once, as a fused multiply-add
    rounds (the product is exact in float64; the sum is rounded to float64
    and then to float32, which differs from one rounding only when the first
    lands on a float32 tie: about once in 2^29)."""
    return (_f64(x) * _f64(y) + _f64(z)).to(torch.float32)


def _f64(v):
    """A float32 tensor or a number in float64 (exactly)."""
    return v.to(torch.float64) if isinstance(v, torch.Tensor) else float(v)


def _not_bool(v):
    """A bool number as 0.0 or 1.0: inductor folds a product with False to
    0 (NaN * False is NaN in eager)."""
    return float(v) if type(v) is bool else v


def _eager_add(negate, self, other, alpha):
    """add/sub with alpha on float32: eager's kernel computes
    fma(other, alpha, self); inductor multiplies, rounds and adds. (Numbers
    come rounded to float32: see _number_rounding; a number is used as it
    is, so that a varying one can be lifted.)"""
    if not negate:
        return _fma(other, alpha, self)
    # self - other * alpha, not a negated alpha: a number is used as it is.
    return (_f64(self) - _f64(other) * _f64(alpha)).to(torch.float32)


def _eager_addcmul(self, t1, t2, value):
    """addcmul on float32: fma(value * tensor1, tensor2, self) (the first
    product rounded); inductor rounds value * tensor1 * tensor2 and adds."""
    return _fma(t1 * _not_bool(value), t2, self)


def _eager_addcdiv(self, t1, t2, value):
    """addcdiv on float32: self + (value * tensor1) / tensor2, in that order
    (inductor's decomposition divides first)."""
    return self + (t1 * _not_bool(value)) / t2


def _eager_lerp(self, end, weight):
    """lerp on float32 as at::lerp: self + weight * (end - self) for
    |weight| < 0.5, else end - (end - self) * (1 - weight), each a fused
    multiply-add; inductor rounds the product first."""
    d = end - self
    if isinstance(weight, torch.Tensor):
        w = weight.to(torch.float32)
        return torch.where(w.abs() < 0.5, _fma(w, d, self), _fma(d, w - 1, end))
    if abs(weight) < 0.5:
        return _fma(weight, d, self)
    # end + (end - self) * (weight - 1): the kernel's form, whose zero is
    # +0.0 (end - d * (1 - w) negated would give -0.0).
    return _fma(d, _float32_number(weight - 1), end)


class _WholeCall:
    """A formula that takes the node's arguments as the op does (self and
    the rest positional, Scalars by name), not just self and other."""

    def __init__(self, fn, names):
        self.fn, self.names = fn, names

    def __call__(self, args, kwargs):
        vals = list(args) + [kwargs[n] for n in self.names[len(args):]]
        return self.fn(*vals)


def _fma_formula(node):
    """For a float32 add/sub with alpha, addcmul, addcdiv or lerp (what
    optimizers' steps are made of): eager's kernel's rounding (see
    _eager_add and the others), which inductor's code does not keep (about
    one element in six is a unit in the last place off: difffuzz seed
    3810534, an argmax over the results). None for other nodes and dtypes."""
    name = node["op"].rstrip("_")
    args = node["args"]
    names = [n for n, _, _ in args]

    def float32_tensor(k):
        kind, value = args[k][2]
        return kind == "t" and value is not None and value[1][3] == torch.float32

    def number(k):
        kind, value = args[k][2]
        return kind == "c" and type(value) in (bool, int, float)

    if name in ("aten::add", "aten::sub"):
        if len(args) < 3 or names[2] != "alpha" or not (float32_tensor(0) and float32_tensor(1)):
            return None
        if not number(2) or args[2][2][1] == 1:
            return None
        return _WholeCall(functools.partial(_eager_add, name == "aten::sub"), ["self", "other", "alpha"])
    if name in ("aten::addcmul", "aten::addcdiv"):
        if len(args) < 4 or names[3] != "value" or not all(float32_tensor(k) for k in range(3)) or not number(3):
            return None
        fn = _eager_addcmul if name == "aten::addcmul" else _eager_addcdiv
        return _WholeCall(fn, ["self", "tensor1", "tensor2", "value"])
    if name == "aten::lerp":
        if len(args) < 3 or names[2] != "weight" or not (float32_tensor(0) and float32_tensor(1)):
            return None
        if not (number(2) or float32_tensor(2)):
            return None
        return _WholeCall(_eager_lerp, ["self", "end", "weight"])
    return None


_BATCH_NORMS = frozenset(("aten::native_batch_norm", "aten::_native_batch_norm_legit",
                          "aten::_native_batch_norm_legit_no_training"))


def _eager_batch_norm(op, names, *vals):
    """A batch norm's result as eager's CPU kernel computes it: per channel
    alpha = invstd * weight and beta = bias - mean * alpha, then x * alpha
    + beta. The decomposition computes (x - mean) * invstd * weight + bias,
    which is +-inf where eager's is NaN for an infinite weight (inf - inf:
    difffuzz seed 3914835). The statistics and the running statistics'
    updates are the decomposition's (its own result is unused)."""
    out, save_mean, save_invstd = op(*vals)
    a = dict(zip(names, vals))
    x, weight, bias = a["input"], a["weight"], a["bias"]
    opmath = torch.float32 if x.dtype in _REDUCED_FLOATS else x.dtype
    if a.get("training", False):
        mean, invstd = save_mean.to(opmath), save_invstd.to(opmath)
    else:
        mean = a["running_mean"].to(opmath)
        invstd = 1 / torch.sqrt(a["running_var"].to(opmath) + a["eps"])
    alpha = invstd * weight.to(opmath) if weight is not None else invstd
    beta = (bias.to(opmath) if bias is not None else 0) - mean * alpha
    shape = [1, -1] + [1] * (x.dim() - 2)
    result = (x.to(opmath) * alpha.view(shape) + beta.view(shape)).to(x.dtype)
    return result, save_mean, save_invstd


def _batch_norm_formula(node):
    """For a batch norm (not its out= variant): _eager_batch_norm."""
    names = [n for n, _, _ in node["args"]]
    if node["op"] not in _BATCH_NORMS or "out" in names:
        return None
    if node["args"][0][2][0] != "t" or node["args"][0][2][1][1][3] not in (torch.float32, torch.float64) + _REDUCED_FLOATS:
        return None
    op = _op(node["op"], node["overload"])
    return _WholeCall(functools.partial(_eager_batch_norm, op, names), names)


def _eager_formula(node):
    """For a node whose op inductor computes otherwise than eager's CPU
    kernel where it matters (a floating remainder or floor division by an
    infinite divisor, a half-precision bmm): eager's formula, a function of
    self and other. None for other nodes; a half or bfloat16 remainder or
    floor division is not compiled (its formula would round between steps
    where the kernel does not)."""
    name = node["op"]
    names = [n for n, _, _ in node["args"]]
    if name == "aten::bmm":
        return _half_bmm_formula(node)
    batch_norm = _batch_norm_formula(node)
    if batch_norm is not None:
        return batch_norm
    fma = _fma_formula(node)
    if fma is not None:
        return fma
    if name in ("aten::remainder", "aten::remainder_"):
        formula = _eager_remainder
    elif name in ("aten::floor_divide", "aten::floor_divide_"):
        formula = _eager_floor_divide
    elif name in ("aten::div", "aten::div_") and "rounding_mode" in names:
        kind, mode = node["args"][names.index("rounding_mode")][2]
        if kind != "c" or mode != "floor":
            return None
        formula = _eager_floor_divide
    else:
        return None
    if node["args"][0][2][0] != "t" and node["args"][1][2][0] != "t":
        return None  # no tensor operand (a number's remainder by a 0-dim one): inductor's code as it is
    dt = _compute_dtype(node)
    if dt is None or not dt.is_floating_point:
        return None  # integers (inductor's code agrees; an out= of another dtype takes the cast)
    if dt in _REDUCED_FLOATS:
        raise Unsupported(f"{name} of a half or bfloat16 tensor")
    return functools.partial(_in_dtype, formula, dt)


def _in_dtype(formula, dtype, a, b):
    """`formula` on a and b in the dtype the op computes in, as eager's
    kernel sees them: a number or tensor of another dtype cast to it first
    (1e-50 is 0 in float32: eager divides by 0 there)."""
    def cast(v):
        if isinstance(v, torch.Tensor):
            return v.to(dtype)
        if type(v) in (bool, int, float) and dtype == torch.float32:
            # Python's own float32 rounding: torch.tensor here would be
            # recorded into the traced graph.
            return _float32_number(v)
        return v
    a, b = cast(a), cast(b)
    if not isinstance(a, torch.Tensor):
        # A number as self (`3.0 // x`, difffuzz seed 3810566: 3.0 // -inf
        # is -1 in eager, -0.0 in inductor's code): as a tensor like b.
        a = torch.full_like(b, a)
    return formula(a, b)


def _call_eager_formula(formula, op_name, args, kwargs):
    """The node's result by `formula` (see _eager_formula), written where the
    op writes: into self for the in-place op, into out= for an out variant."""
    a = args[0] if args else kwargs["self"]
    if isinstance(formula, _WholeCall):
        result = formula(args, kwargs)
    else:
        b = args[1] if len(args) > 1 else kwargs.get("other")
        result = formula(a, b)
    if op_name.endswith("_"):
        return a.copy_(result)
    if kwargs.get("out") is not None:
        return kwargs["out"].copy_(result)
    return result


def _tensor_refs(node):
    """The tensor arguments of a recorded node: (operand, geometry, tag)
    or None for a hole of a Tensor?[] list."""
    for _, _, (kind, value) in node["args"]:
        if kind == "t":
            yield value
        elif kind != "c":
            yield from value


def replay_fn(req, subst=None):
    """The graph as a function of its leaves' bytes (flat tensors),
    returning the roots: a fresh output as the op returned it, a storage
    written in place as its flat bytes. `subst`: (node, argument) -> a
    value traced in place of that constant."""
    subst = subst or {}
    # A device argument was recorded as the host (mgpu's values live on
    # the lanes): the lanes' device, as tier 0 runs it.
    lanes_device = torch.device(req.get("device", "cpu"))
    n_leaves = len(req["leaves"])
    nodes = req["nodes"]
    roots = req["roots"]
    # Where each value is last read, so a write copies only what is read after.
    last_read = {}
    for i, node in enumerate(nodes):
        for v in node["operands"]:
            last_read[v] = i
    root_set = set(roots)
    ops = [_op_for_args(n) for n in nodes]
    formulas = {i: f for i, n in enumerate(nodes) for f in [_eager_formula(n) or _unary_formula(n)] if f is not None}
    # Values that are new versions of a storage (in-place writes): a root
    # of them is returned as the storage's flat bytes.
    written_nbytes = {value: nbytes for n in nodes for value, mutated, _, nbytes, _ in n["outputs"] if mutated >= 0}
    # Products whose result is floating or complex (see the integer 0 below).
    float_products = {i for i, n in enumerate(nodes) if n["op"] in ("aten::mul", "aten::mul_") and any(
        dt.is_floating_point or dt.is_complex for dt in _result_dtypes(n))}
    # A varying alpha of add/sub (SGD's `p.add_(g, alpha=-lr)` under a
    # schedule) is a Scalar argument, which compiled code can only bake in:
    # such a node is traced as add/sub of `other * alpha`, whose number is a
    # Tensor operand the constant's input can take the place of. (Eager's
    # kernel rounds once, a fused multiply-add; inductor's code for the
    # baked alpha multiplies and adds too.) Not for a half dtype, whose
    # product would be rounded between the two.
    varying = {tuple(v) for v in req.get("varying", ())}
    alpha_factor = {i: k for i, k in varying if nodes[i]["op"] in ("aten::add", "aten::add_", "aten::sub", "aten::sub_")
                    and nodes[i]["args"][k][0] == "alpha" and _compute_dtype(nodes[i]) in (torch.float32, torch.float64)}
    # The numbers eager rounds to a half dtype, rounded here, before
    # tracing (rounding while tracing would record the rounding's ops).
    rounded = {(i, k): _rounded(value, dt) for i, dt in _number_rounding(nodes).items()
               for k, (_, _, (kind, value)) in enumerate(nodes[i]["args"]) if kind == "c"}
    # Each value's storage size (a written one's: the storage's after the write).
    value_nbytes = {value: nbytes for n in nodes for value, _, _, nbytes, _ in n["outputs"]}

    def run(*leaves):
        # value -> (base tensor, fresh geometry): a leaf's or a written
        # storage's flat bytes (fresh None), or a fresh output as the op
        # returned it, which the recording says lies in its storage as
        # `fresh` lays it out.
        env = {k: (leaves[k], None) for k in range(n_leaves)}
        inputs = {id(leaf) for leaf in leaves}  # the graph's own inputs (for view())
        flat_of = {}  # fresh output -> its storage's bytes, laid out as recorded

        def laid_out(v):
            """The bytes of the storage of `v`, a fresh output (or one
            written in place as itself, which keeps its fresh geometry):
            its values placed as its recorded geometry places them. The traced op's result
            need not be laid out so (a decomposition keeps its input's
            strides where the CPU kernel's result is contiguous, and
            inductor lays out its buffers as it likes), so a view that
            reads the storage by strides reads these bytes."""
            if v not in flat_of:
                base, (sizes, strides, offset) = env[v]
                flat = base.new_empty(value_nbytes[v] // base.element_size())
                torch.as_strided(flat, sizes, strides, offset).copy_(base)
                flat_of[v] = flat
            return flat_of[v]

        def view(v, geom, written=False):
            base, fresh = env[v]
            sizes, strides, offset, dtype = geom
            if base.dtype != dtype:
                raise Unsupported("a storage read as another dtype")
            if fresh is not None and fresh == (sizes, strides, offset):
                return base
            numel = 1
            for d in sizes:
                numel *= d
            if fresh is not None:
                fsizes, fstrides, foffset = fresh
                fnumel = 1
                for d in fsizes:
                    fnumel *= d
                if (foffset == offset == 0 and numel == fnumel and _contiguous(fsizes, fstrides)
                        and _contiguous(sizes, strides)):
                    # The same elements in the same order (view, flatten,
                    # unsqueeze of a contiguous result): a reshape of the
                    # values, whatever the traced result's layout.
                    return base.reshape(sizes)
                perm = _permutation(fresh, (sizes, strides, offset))
                if perm is not None:
                    return base.permute(perm)  # t(), transpose, permute: by the values too
                base = laid_out(v)
            if _contiguous(sizes, strides) and offset + numel <= base.numel():
                # Views inductor follows better than as_strided.
                return base.narrow(0, offset, numel).view(sizes)
            # A buffer the graph made is read by views or a gather (see
            # _strided_read); one the op writes through the view must be
            # its bytes (as_strided).
            if not written and id(base) not in inputs:
                return _strided_read(base, sizes, strides, offset)
            return torch.as_strided(base, sizes, strides, offset)

        for i, (node, op) in enumerate(zip(nodes, ops)):
            operands = node["operands"]
            # out= tensors the op sizes (fresh and empty: the engine takes no
            # other): passed at their size after the call, in new bytes.
            grown = {}
            for arg, element, after in node.get("written", ()):
                kind, value = node["args"][arg][2]
                r = value if kind == "t" else value[element]
                if r is not None and tuple(r[1][:3]) != tuple(after[:3]):
                    grown[r[0]] = after
            written = {}
            for value, mutated, _, nbytes, _ in node["outputs"]:
                if mutated >= 0:
                    v = operands[mutated]
                    base, fresh = env[v]
                    if mutated in grown:
                        if base.numel() != 0:
                            raise Unsupported("an out= tensor resized over bytes it had")
                        base = torch.empty(nbytes // base.element_size(), dtype=base.dtype, device=base.device)
                        fresh = None  # new flat bytes: no longer the empty result it was
                    elif fresh is not None and any(r is not None and r[0] == mutated and tuple(r[1][:3]) != fresh
                                                   for r in _tensor_refs(node)):
                        # Written through another view than the result
                        # itself: into its bytes, laid out as recorded (a copy).
                        base, fresh = laid_out(v).clone(), None
                    elif v < n_leaves or last_read.get(v, -1) > i or v in root_set:
                        base = torch.clone(base)
                    written[mutated] = (base, fresh)
            saved = {}
            for m, entry in written.items():
                saved[operands[m]] = env[operands[m]]
                env[operands[m]] = entry
            same = {}

            def tensor(r):
                if r is None:
                    return None
                operand, geom, tag = r
                if tag >= 0 and tag in same:
                    return same[tag]
                t = view(operands[operand], grown.get(operand, geom), written=operand in written)
                if tag >= 0:
                    same[tag] = t
                return t

            args, kwargs = [], {}
            for k, (name, kwarg_only, (kind, value)) in enumerate(node["args"]):
                if kind == "c":
                    a = subst.get((i, k), value)
                    if isinstance(a, torch.device) and a.type == "cpu":
                        a = lanes_device
                    elif type(a) in (int, bool) and a == 0 and i in float_products:
                        # Inductor folds a product with the integer 0 to 0,
                        # whatever the other factor: NaN * 0 and inf * 0
                        # would give 0, where eager gives NaN (difffuzz
                        # seed 3740135, `0 / x`: reciprocal(x) * 0; seed
                        # 3760406, `x * False`). The float 0.0 gives the
                        # same dtype and is not folded.
                        a = 0.0
                    elif (i, k) in rounded and (i, k) not in subst:
                        # (A lifted one is traced as its stand-in and
                        # rounded where the compiled code is called.)
                        a = rounded[(i, k)]
                elif kind == "t":
                    a = tensor(value)
                else:
                    a = [tensor(r) for r in value]
                if i in alpha_factor and k == alpha_factor[i] and i not in formulas:
                    args[1] = args[1] * a  # other * alpha, and no alpha
                elif kwarg_only:
                    kwargs[name] = a
                else:
                    args.append(a)
            if (node["op"] in _REDUCES_IN_OUT_DTYPE and kwargs.get("out") is not None and "dtype" in kwargs
                    and kwargs["dtype"] is None):
                # Eager's kernel reduces in out='s dtype, its input cast
                # first; the traced decomposition reduces in the input's
                # and casts the result (difffuzz seed 3790022: a float16
                # sum into an int64 out=, 3 in eager, 2 traced).
                kwargs["dtype"] = kwargs["out"].dtype
            if (node["op"] == "aten::copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor)
                    and args[0].dtype == torch.bool and args[1].dtype != torch.bool):
                # A conversion to bool (`x.bool()` records a copy_ into a
                # bool tensor) as eager means it, nonzero: inductor folded
                # the dtype copy of a fused arange away (difffuzz seed
                # 3915445: arange(3).bool() + -1.5 added 2, not True).
                args[1] = args[1] != 0
            if i in formulas:
                out = _call_eager_formula(formulas[i], node["op"], args, kwargs)
            else:
                out = op(*args, **kwargs)
            for v, entry in saved.items():
                env[v] = entry
            # The returns flattened as the recording numbered them: tensors
            # and undefined ones (None: a backward's masked-out gradient).
            flat = []
            stack = [out]
            while stack:
                x = stack.pop(0)
                if isinstance(x, (list, tuple)):
                    stack[:0] = list(x)
                elif isinstance(x, torch.Tensor) or x is None:
                    flat.append(x)
            for value, mutated, returned, _, geom in node["outputs"]:
                if mutated >= 0:
                    env[value] = written[mutated]
                else:
                    t = flat[returned]
                    sizes, strides, offset, _ = geom
                    if offset != 0:
                        raise Unsupported("a fresh output at an offset")
                    env[value] = (t, (sizes, strides, offset))
        def result(v):
            base, fresh = env[v]
            if v in written_nbytes and fresh is not None:
                # A write into a value the graph made: its storage's bytes,
                # as a leaf's are (flat), in the geometry it was made with.
                sizes, strides, offset = fresh
                flat = base.new_empty(written_nbytes[v] // base.element_size())
                torch.as_strided(flat, sizes, strides, offset).copy_(base)
                return flat
            return base
        return tuple(result(v) for v in roots)

    return run


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
        for k, (_, _, (kind, value)) in enumerate(node["args"]):
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
    it runs the op's own kernel)."""
    from torch._decomp import core_aten_decompositions

    table = core_aten_decompositions()
    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,):
        table.pop(op, None)
    return table


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


def loop_threads():
    """OpenMP threads of a compiled graph's loops: the cores each lane has.
    The lanes are the parallelism; loops on two threads that share two
    cores with the other lane (or another process) wait at every loop's
    barrier for the core the other thread lost: a 64-column graph ran
    130 ms a call instead of 0.1 ms on a loaded 2-core machine."""
    from .compile import _cpu_threads
    return _cpu_threads(len(_C.lanes()))


def compile_request(req):
    """(compiled function, input dtypes, description, lifted constants) for
    one hot graph, or one part of a split one (`req["split"]`: its number
    of parts), for the lanes' device (`req["device"]`: the host, or the GPU
    whose streams the lanes are). A host part runs beside the others: it is
    compiled with the C++ wrapper, which lets go of the GIL, and its loops
    take its lane's share of the cores."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from .compile import _cpu_threads

    dtypes = _flat_dtypes(req)
    device = torch.device(req.get("device", "cpu"))
    examples = []
    for nbytes, dt in zip(req["leaves"], dtypes):
        itemsize = torch.empty(0, dtype=dt).element_size()
        examples.append(torch.zeros(nbytes // itemsize, dtype=dt, device=device))
    split = req.get("split", 0) > 1
    with torch.no_grad():
        gm, lifted = lift(req, examples)
        examples += [torch.tensor(0.5, dtype=torch.float64, device=device) for _ in lifted]
        # Tier 0's numbers: a half or bfloat16 result is rounded to its
        # dtype between fused ops, as eager does (inductor keeps float32
        # across them, and a floor or a comparison then differs by a whole
        # unit).
        patches = {"cpp.threads": _cpu_threads(req["lanes"]) if split else loop_threads(),
                   "emulate_precision_casts": True}
        if split and device.type == "cpu":
            # A host part's loops run in the wrapper: the C++ one lets go
            # of the GIL. A CUDA part's Python wrapper only queues kernels
            # on its lane's stream (the current one when it is called).
            patches["cpp_wrapper"] = True
        with inductor_config.patch(patches):
            compiled = compile_fx(gm, examples)

    # Lifted numbers that eager rounds to a half dtype (see
    # _number_rounding) are rounded as they are passed.
    rounding = _number_rounding(req["nodes"])
    rounded_inputs = [(len(req["leaves"]) + j, rounding[node]) for j, (node, _) in enumerate(lifted) if node in rounding]

    def call(tensors):
        if rounded_inputs:
            tensors = list(tensors)
            for pos, dt in rounded_inputs:
                tensors[pos] = tensors[pos].to(dt).to(tensors[pos].dtype)
        with torch.no_grad():
            return list(compiled(*tensors))

    ops = sorted({n["op"].split("::")[-1] for n in req["nodes"]})
    description = f"{len(req['nodes'])} ops ({', '.join(ops[:6])}{', ...' if len(ops) > 6 else ''})"
    if lifted:
        description += f", {len(lifted)} constant(s) as inputs"
    return call, dtypes, description, lifted


def compile_ways(req):
    """The ways a hot graph is compiled, each (parts, compile seconds,
    description), a part (function, dtypes, lifted constants, description):
    the whole graph as one part, and for a graph with independent branches
    (`req["parts"]`) also its parts, run side by side on the lanes. The
    engine times each way on trial and keeps the fastest."""
    ways = []
    t0 = time.perf_counter()
    fn, dtypes, description, lifted = compile_request(req)
    seconds = time.perf_counter() - t0
    ways.append(([(fn, dtypes, lifted, description)], seconds, f"{description}; compiled in {seconds:.2f} s"))
    parts = req["parts"]
    if parts:
        t0 = time.perf_counter()
        try:
            compiled = [compile_request(dict(part, split=len(parts), lanes=req["lanes"])) for part in parts]
        except Exception as e:  # the parts do not compile: the whole graph still may run in tier 1
            whole, seconds, description = ways[0]
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            if len(reason) > 300:
                reason = reason[:297] + "..."
            ways[0] = (whole, seconds, f"{description}; its {len(parts)} parts did not compile ({reason})")
            return ways
        seconds = time.perf_counter() - t0
        lanes = {}
        for part, (_, _, d, _) in zip(parts, compiled):
            lanes.setdefault(part["lane"], []).append(d)
        ops = sum(len(p["nodes"]) for p in parts)
        description = f"{ops} ops in {len(parts)} parts on {len(lanes)} lanes: " + "; ".join(
            f"lane {lane}: " + " then ".join(d) for lane, d in sorted(lanes.items()))
        ways.append(([(fn, dtypes, lifted, d) for fn, dtypes, d, lifted in compiled], seconds,
                     f"{description}; compiled in {seconds:.2f} s"))
    return ways


@contextlib.contextmanager
def _apart_from_dynamo():
    """Serializes a tier-1 compile with torch.compile's frame compiles, and
    keeps compiled functions called meanwhile on other threads from seeing
    this thread's FX trace as theirs."""
    try:
        from torch._dynamo import config, convert_frame
        lock = convert_frame.compile_lock
    except (ImportError, AttributeError):  # another torch: no guard to take
        yield
        return
    # The setting's default, not an override: overrides are thread-local,
    # and it is the other threads' calls that must see it.
    entry = getattr(config, "_config", {}).get("force_compile_during_fx_trace")
    with lock:
        if entry is None or not hasattr(entry, "default"):
            yield
            return
        saved = entry.default
        entry.default = True
        try:
            yield
        finally:
            entry.default = saved


def _serve():
    while True:
        req = _C._tier_next_request()
        if req is None:
            return
        try:
            with _apart_from_dynamo():
                ways = compile_ways(req)
        except Exception as e:  # the graph stays in tier 0
            _C._tier_reject(req["key"], f"{type(e).__name__}: {e}")
            continue
        _C._tier_install(req["key"], ways)


def start():
    """Starts the compile thread (once per process)."""
    global _thread
    with _lock:
        if _thread is not None and _thread.is_alive():
            return
        _C._tier_compiler_present(True)
        _thread = threading.Thread(target=_serve, name="torch_mgpu-compile", daemon=True)
        _thread.start()


def stop(timeout: float = 30.0):
    """Stops the compile thread and waits for it (at exit: a thread left
    waiting in C++ for the next hot graph would be torn down by the
    interpreter's finalization as it takes the GIL back, which aborts the
    process). A compile in progress is waited for up to `timeout` seconds."""
    _C._tier_stop()
    with _lock:
        thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


def set_compile(hits):
    """configure(compile=...): False / 0 turns tier 1 off, True takes the
    default hit count (2), an int sets it."""
    if hits is True:
        hits = 2
    elif hits is False or hits is None:
        hits = 0
    hits = int(hits)
    if hits < 0:
        raise ValueError(f"compile must be a bool or a hit count >= 0, got {hits}")
    _C._set_tier_compile_hits(hits)
    if hits:
        start()


def wait_for_compiles(timeout: float = 600.0) -> bool:
    """Waits until no hot graph is queued or compiling; True when none is."""
    return _C._tier_wait(float(timeout))
