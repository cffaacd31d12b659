"""Eager's numerics where inductor's code differs: which number operands
eager rounds to the tensor's dtype, and formulas replayed in place of an op
(a floating remainder or floor division, float32 erf, a half-precision bmm,
optimizers' multiply-adds, a batch norm's result) so that a compiled graph
computes what tier 0 computes."""
import functools
import math
import struct

import torch

from .common import Unsupported, _op, is_contiguous


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
    return [o.geom.dtype for o in node["outputs"] if o.mutated < 0] + [w.after.dtype for w in node.get("written", ())]


def _compute_dtype(node):
    """The dtype a binary op computes in: the result type of its first two
    arguments (self, other) as the call promoted them (a tensor's dtype,
    0-dim or not, a number's kind), not the dtype it writes (an out= or
    in-place tensor of another dtype is cast to at the end). None where
    they are not a tensor and a number or two tensors."""
    vals = []
    for _, _, kind, value in node["args"][:2]:
        if kind == "t" and value is not None:
            sizes, dtype = value.geom.sizes, value.geom.dtype
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
    if node["op"] not in ("aten::erf", "aten::erf_") or node["args"][0].kind != "t":
        return None
    if node["args"][0].value.geom.dtype != torch.float32:
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
    a, b = (node["args"][k] for k in range(2))
    if a.kind != "t" or b.kind != "t" or a.value is None or b.value is None:
        return None
    dt = a.value.geom.dtype
    if dt not in _REDUCED_FLOATS:
        return None
    (_, m, k), (_, _, n) = a.value.geom.sizes, b.value.geom.sizes
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
    names = [a.name for a in args]

    def float32_tensor(k):
        kind, value = args[k].kind, args[k].value
        return kind == "t" and value is not None and value.geom.dtype == torch.float32

    def number(k):
        kind, value = args[k].kind, args[k].value
        return kind == "c" and type(value) in (bool, int, float)

    if name in ("aten::add", "aten::sub"):
        if len(args) < 3 or names[2] != "alpha" or not (float32_tensor(0) and float32_tensor(1)):
            return None
        if not number(2) or args[2].value == 1:
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
    """A batch norm as eager's CPU kernel computes it. Training: the mean as
    a sum over the count, the variance's sum of squares about it, invstd =
    1 / sqrt(var + eps), the running statistics momentum * stat + (1 -
    momentum) * running (the variance unbiased); the decomposition's
    one-pass (Welford) statistics are NaN where eager's mean is infinite
    (difffuzz seed 3924393: 2 / 0 in the batch). Then per channel alpha =
    invstd * weight and beta = bias - mean * alpha, and x * alpha + beta:
    the decomposition's (x - mean) * invstd * weight + bias is +-inf where
    eager's is NaN for an infinite weight (inf - inf: seed 3914835). In eval
    mode the op's own saved (empty) statistics."""
    a = dict(zip(names, vals))
    x, weight, bias = a["input"], a["weight"], a["bias"]
    opmath = torch.float32 if x.dtype in _REDUCED_FLOATS else x.dtype
    shape = [1, -1] + [1] * (x.dim() - 2)
    if a.get("training", False):
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // x.size(1)
        xf = x.to(opmath)
        mean = xf.sum(dims) / n
        var_sum = ((xf - mean.view(shape)) ** 2).sum(dims)
        invstd = 1 / torch.sqrt(var_sum / n + a["eps"])
        m = a["momentum"]
        running_mean, running_var = a.get("running_mean"), a.get("running_var")
        if running_mean is not None:
            running_mean.copy_(m * mean + (1 - m) * running_mean.to(opmath))
        if running_var is not None:
            running_var.copy_(m * (var_sum / (n - 1)) + (1 - m) * running_var.to(opmath))
        saved = weight.dtype if weight is not None else running_mean.dtype if running_mean is not None else x.dtype
        save_mean, save_invstd = mean.to(saved), invstd.to(saved)
    else:
        _, save_mean, save_invstd = op(*vals)
        mean = a["running_mean"].to(opmath)
        invstd = 1 / torch.sqrt(a["running_var"].to(opmath) + a["eps"])
    alpha = invstd * weight.to(opmath) if weight is not None else invstd
    beta = (bias.to(opmath) if bias is not None else 0) - mean * alpha
    result = (x.to(opmath) * alpha.view(shape) + beta.view(shape)).to(x.dtype)
    return result, save_mean, save_invstd


def _batch_norm_formula(node):
    """For a batch norm (not its out= variant): _eager_batch_norm."""
    names = [a.name for a in node["args"]]
    if node["op"] not in _BATCH_NORMS or "out" in names:
        return None
    x = node["args"][0]
    if x.kind != "t" or x.value.geom.dtype not in (torch.float32, torch.float64) + _REDUCED_FLOATS:
        return None
    op = _op(node["op"], node["overload"])
    return _WholeCall(functools.partial(_eager_batch_norm, op, names), names)


_BYTE_DTYPES = (torch.bool, torch.uint8, torch.int8)
_INDEX_REDUCTIONS = {("aten::min", "dim"), ("aten::max", "dim"), ("aten::argmin", ""), ("aten::argmax", "")}


def _byte_index_reduction(op, names, *vals):
    """The index of a min or max (min.dim, max.dim, argmin, argmax) over
    bool or one-byte integers, over int32 values: inductor's code over the
    bytes gave the index of the first True for a bool min (difffuzz seed
    3924806: [True, False].min(0) gave index 0), and its vectorized code
    along the innermost dim other indices than eager's first minimum, some
    holding no minimum (seed 3965385: a bool min(-1) over 79, 50 of 112)."""
    a = dict(zip(names, vals))
    x = a["self"]
    rest = [a[n] for n in names[1:]]
    out = op(x.to(torch.int32), *rest)
    if isinstance(out, tuple):
        values, indices = out
        return values.to(x.dtype), indices
    return out


def _byte_index_formula(node):
    """For the index reductions (not their out= variants) of bool or
    one-byte values: _byte_index_reduction."""
    names = [a.name for a in node["args"]]
    if (node["op"], node["overload"]) not in _INDEX_REDUCTIONS or "out" in names:
        return None
    x = node["args"][0]
    if x.kind != "t" or x.value.geom.dtype not in _BYTE_DTYPES:
        return None
    return _WholeCall(functools.partial(_byte_index_reduction, _op(node["op"], node["overload"]), names), names)


_NLL_LOSSES = frozenset(("aten::nll_loss_forward", "aten::nll_loss2d_forward"))


def _eager_nll_loss(op, names, *vals):
    """An nll loss whose result is zero, signed as eager's CPU kernel signs
    it: a reduced loss (and a 1-d input's) is accumulated as 0 - x * w,
    which is +0.0 where the decomposition's -(x * w) is -0.0; a mean then
    divides by the total weight (-0.0 for a negative one). One class of
    cross_entropy is such a zero (difffuzz seed 3927966: a later `//` by it
    gave -inf where eager gives +inf)."""
    a = dict(zip(names, vals))
    output, total_weight = op(*vals)
    reduction = a["reduction"]
    if reduction == 0 and a["self"].dim() != 1:
        return output, total_weight  # per element -x * w, as the kernel writes it
    zero = torch.zeros_like(output)
    if reduction == 1:  # mean
        zero = zero / total_weight.to(output.dtype)
    return torch.where(output == 0, zero, output), total_weight


def _nll_loss_formula(node):
    """For an nll loss (not its out= variant): _eager_nll_loss."""
    names = [a.name for a in node["args"]]
    if node["op"] not in _NLL_LOSSES or "output" in names or "out" in names:
        return None
    x = node["args"][0]
    if x.kind != "t" or not x.value.geom.dtype.is_floating_point:
        return None
    reduction = node["args"][names.index("reduction")]
    if reduction.kind != "c":
        return None
    return _WholeCall(functools.partial(_eager_nll_loss, _op(node["op"], node["overload"]), names), names)


@functools.lru_cache(maxsize=None)
def _eager_gelu_of_infinities(dtype):
    """(gelu(+inf), gelu(-inf)) as eager's CPU kernel computes them in a
    contiguous tensor of two or more elements (its vectorized path): they
    differ with the CPU's vector instructions (NaN for +inf with AVX-512,
    +inf with AVX2, as the formula inductor compiles gives)."""
    inf = float("inf")
    x = torch.zeros(67, dtype=dtype)  # the infinities in the vector loop's body, not only its tail
    x[0], x[1] = inf, -inf
    out = torch.nn.functional.gelu(x)
    return out[0].item(), out[1].item()


def _same_number(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def _eager_gelu(names, at_infinities, *vals):
    """gelu (the erf form) as eager's CPU kernel computes it on a
    contiguous float32 or bfloat16 tensor of two or more elements: its
    values at +inf and -inf (`at_infinities`), where they are not the
    formula's (difffuzz seed 3936822: NaN for +inf on an AVX-512 CPU). Out
    of place, so that an infinity is read from the input before an
    in-place gelu_ writes it."""
    a = dict(zip(names, vals))
    x = a["self"]
    out = torch.ops.aten.gelu.default(x, approximate="none")
    at_pos, at_neg = at_infinities
    out = torch.where(x == float("inf"), torch.full_like(out, at_pos), out)
    return torch.where(x == -float("inf"), torch.full_like(out, at_neg), out)


def _gelu_formula(node, device):
    """For gelu and gelu_ (the erf form) on host lanes where eager's CPU
    kernel takes its vectorized path and gives other values at the
    infinities than the formula inductor compiles (+inf, NaN): _eager_gelu.
    Its scalar path (one element, a strided tensor, half precision, float64)
    gives the formula's, and so does CUDA's kernel (the probe reads the
    host's CPU, not the GPU's: on CUDA lanes no rewrite)."""
    names = [a.name for a in node["args"]]
    if node["op"] not in ("aten::gelu", "aten::gelu_") or "out" in names or device.type != "cpu":
        return None
    if "approximate" in names:
        approximate = node["args"][names.index("approximate")]
        if approximate.kind != "c" or approximate.value != "none":
            return None
    x = node["args"][0]
    if x.kind != "t" or x.value.geom.dtype not in (torch.float32, torch.bfloat16):
        return None
    geom = x.value.geom
    if math.prod(geom.sizes) < 2 or not is_contiguous(geom.sizes, geom.strides):
        return None
    at_infinities = _eager_gelu_of_infinities(geom.dtype)
    if at_infinities[0] == float("inf") and math.isnan(at_infinities[1]):
        return None
    return _WholeCall(functools.partial(_eager_gelu, names, at_infinities), names)


# Linear, bilinear and bicubic upsampling as their kernels compute them.
# The linear decompositions interpolate x0 + (x1 - x0) * w, NaN where the
# kernel's x0 * (1 - w) + x1 * w is +-inf (an infinite x0 beside a finite x1
# with w = 0, two equal infinite taps; difffuzz seed 3967375); the bicubic
# one rounds a bfloat16 sum between its steps (a unit of 0.0078 apart at
# 0.08). Compiled code calls the kernel through an op of this library,
# which no decomposition table or tracer's dispatcher opens (bilinear's
# Python kernel at the Autograd key decomposes it in any trace).
def _linear1d(x: torch.Tensor, output_size: list[int], align_corners: bool,
              scales_w: float | None = None) -> torch.Tensor:
    return torch.ops.aten.upsample_linear1d.default(x, output_size, align_corners, scales_w)


def _bilinear2d(x: torch.Tensor, output_size: list[int], align_corners: bool,
                scales_h: float | None = None, scales_w: float | None = None) -> torch.Tensor:
    return torch.ops.aten.upsample_bilinear2d.default(x, output_size, align_corners, scales_h, scales_w)


def _bicubic2d(x: torch.Tensor, output_size: list[int], align_corners: bool,
               scales_h: float | None = None, scales_w: float | None = None) -> torch.Tensor:
    return torch.ops.aten.upsample_bicubic2d.default(x, output_size, align_corners, scales_h, scales_w)


_KERNEL_CALLS = {}
for _name, _fn in (("upsample_linear1d", _linear1d), ("upsample_bilinear2d", _bilinear2d),
                   ("upsample_bicubic2d", _bicubic2d)):
    _KERNEL_CALLS[f"aten::{_name}"] = torch.library.custom_op(f"torch_mgpu::{_name}", _fn, mutates_args=())
    _KERNEL_CALLS[f"aten::{_name}"].register_fake(_fn)


def _kernel_formula(node):
    """For linear, bilinear and bicubic upsampling (not their out=
    variants): the kernel's call (_KERNEL_CALLS)."""
    names = [a.name for a in node["args"]]
    fn = _KERNEL_CALLS.get(node["op"])
    if fn is None or node["overload"] != "" or "out" in names:
        return None
    return _WholeCall(fn, names)


def _eager_formula(node, device):
    """For a node whose op inductor computes otherwise than eager's CPU
    kernel where it matters (a floating remainder or floor division by an
    infinite divisor, a half-precision bmm): eager's formula, a function of
    self and other. None for other nodes; a half or bfloat16 remainder or
    floor division is not compiled (its formula would round between steps
    where the kernel does not). `device`: the lanes' (gelu's values at the
    infinities are the host CPU's, rewritten on host lanes only)."""
    name = node["op"]
    names = [a.name for a in node["args"]]
    if name == "aten::bmm":
        return _half_bmm_formula(node)
    gelu = functools.partial(_gelu_formula, device=device)
    for find in (_kernel_formula, _batch_norm_formula, _byte_index_formula, _nll_loss_formula, gelu, _fma_formula):
        formula = find(node)
        if formula is not None:
            return formula
    if name in ("aten::remainder", "aten::remainder_"):
        formula = _eager_remainder
    elif name in ("aten::floor_divide", "aten::floor_divide_"):
        formula = _eager_floor_divide
    elif name in ("aten::div", "aten::div_") and "rounding_mode" in names:
        rounding_mode = node["args"][names.index("rounding_mode")]
        kind, mode = rounding_mode.kind, rounding_mode.value
        if kind != "c" or mode != "floor":
            return None
        formula = _eager_floor_divide
    else:
        return None
    if node["args"][0].kind != "t" and node["args"][1].kind != "t":
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
