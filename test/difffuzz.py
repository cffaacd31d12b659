#!/usr/bin/env python3
"""Differential fuzzing of the mgpu device against eager CPU.

A program is a list of one-line Python statements over named values
(``v0``, ``v1``, ...), generated from a seeded ``random.Random``. Each
candidate statement is run on CPU while the program is generated, so every
later choice knows the shapes, dtypes and autograd state it builds on. The
finished program then runs once with ``dev = "cpu"`` and once with
``dev = "mgpu"`` under each lane configuration (CONFIGS), and every
statement's outcome is compared:

* at the statement: the exception class it raised (both sides must raise
  the same class), or the dtype, shape and requires_grad of each value it
  defined (metadata never syncs mgpu);
* at the end of the program: every value it defined, read back to the host.
  Reading a value earlier would add a sync point the program does not have;
  a value that a later in-place op changed is compared after that change, on
  both sides. Floating and complex values are compared with
  torch.testing.assert_close (equal_nan), integer and bool values exactly;
* then the final torch_mgpu.synchronize(), which must not raise.

Mismatches are grouped by signature: the kind of mismatch and the kind of
statement (its tag), after leaving out those that follow from an earlier one
(see primary()). The first program of each group is shrunk by delta
debugging (dropping a statement drops the statements that read what it
defined, transitively) to a small one that still shows a mismatch of the
same signature, and printed as a runnable snippet.

    python test/difffuzz.py --programs 200 --seed 0
    python test/difffuzz.py --programs 200 --seed 2000000  # with torch.nn.functional (NN_SEEDS)
    python test/difffuzz.py --programs 200 --seed 3000000  # and float16 / bfloat16 (HALF_SEEDS)
    python test/difffuzz.py --seconds 600
    python test/difffuzz.py --seed 17 --show        # print a program

From the command line the programs run in a worker process: a program that
crashes or hangs mgpu costs the worker, not the run. Statements run as code
compiled under the file name ``<difffuzz seed=S stmt=I>`` (and
``<difffuzz seed=S read NAME>`` for the reads at the end), so that
faulthandler's traceback names the program; it is recorded, shrunk (each
candidate in a child process) and the next worker resumes after it.
``--timeout`` bounds one program run. fuzz(), which test/test_difffuzz.py
calls, runs everything in the calling process.
"""
import argparse
import ast
import builtins
import contextlib
import dataclasses
import faulthandler
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import warnings

if __name__ == "__main__":
    # Warnings that ops raise on mgpu's lanes go to the C++ log; keep the
    # report readable (eager's own go to Python's warnings, ignored here).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

import torch_mgpu  # noqa: E402

# Names the generated programs bind: v* values on the program's device (or
# results such as None from autograd.grad), h* host copies, s* Python values
# (numbers from .item(), lists, strides).
VAR = re.compile(r"[vhs]\d+$")

# Values larger than this (the occasional large input and its views) are
# only given to ops whose result is no larger than their input; products
# and broadcasts stay among the small ones.
SMALL = 4096
# A statement that makes a value larger than this is dropped.
LARGEST = 1 << 20

# Programs of seeds from here up also call torch.nn.functional (norms,
# convolutions, pools, attention, losses); smaller seeds generate what they
# did before those were added, so that programs found then stay reproducible.
NN_SEEDS = 2_000_000
# Programs of seeds from here up also make float16 and bfloat16 tensors
# (inputs, factories, casts); they call torch.nn.functional too.
HALF_SEEDS = 3_000_000

# A statement that raised on CPU without being meant to is kept with this
# probability (its outcome, the exception class, is compared like any other).
KEEP_UNPLANNED_ERROR = 0.3


@dataclasses.dataclass(frozen=True)
class Config:
    """A lane configuration the mgpu side runs under."""
    name: str
    devices: tuple
    lanes_per_device: int
    policy: str = "auto"
    async_ops: int = 0           # background flights after this many pending ops (0: off)
    # Tier 1: the program runs three times on mgpu, the third run's values
    # are compared. The first two make each of its graphs hot (a graph is
    # compiled once its second run showed which constants vary); the
    # graphs are compiled (waited for) and the third run calls the compiled
    # code, with no trial against tier 0 (it would run tier 0 in turns).
    tier1: bool = False
    # Every op at its call (configure(at_call="on")): eager's kernels from
    # the calls, no recording.
    at_call: bool = False
    # Floating values compare within assert_close's tolerances for their
    # dtype, or these where they are looser (compiled code rounds otherwise:
    # a batch norm over equal values gives 0 where eager gives 2e-5).
    rtol: float = 0.0
    atol: float = 0.0

    def setup_lines(self):
        lines = [f"torch_mgpu.configure(devices={list(self.devices)!r}, "
                 f"lanes_per_device={self.lanes_per_device}, policy={self.policy!r})",
                 f"torch_mgpu.set_async_ops({self.async_ops})"]
        if self.tier1:
            lines += ["torch_mgpu.configure(compile=1)", "torch_mgpu._C._set_tier_trial(False)"]
        lines.append(f"torch_mgpu.configure(at_call={'on' if self.at_call else 'off'!r})")
        return lines

    def warm_up_lines(self, indent=""):
        """For tier 1: the script's lines that run the program once on mgpu
        and wait for its graphs to compile (a statement that raises there
        raises in the run that counts too)."""
        if not self.tier1:
            return []
        return [f"{indent}for _ in range(2):  # tier 0, read as below: its graphs get hot", f"{indent}    try:",
                f'{indent}        hot = program("mgpu")',
                f"{indent}        if isinstance(hot, torch.Tensor):", f"{indent}            hot.cpu()",
                f"{indent}        torch_mgpu.synchronize()", f"{indent}    except Exception:", f"{indent}        pass",
                f"{indent}assert torch_mgpu.wait_for_compiles(600)"]


CONFIGS = (
    Config("1 lane", ("cpu",), 1),
    Config("2 lanes heft", ("cpu",), 2, policy="heft"),
    Config("2 virtual devices", ("cpu", "cpu"), 1, policy="heft"),
    Config("2 lanes, flights of 3", ("cpu",), 2, async_ops=3),
    Config("at the call", ("cpu",), 2, at_call=True),
)
# Not among the defaults: each program's graphs are compiled by inductor
# (seconds each). `--configs 5`.
TIER1_WARM_UP = 2
TIER1 = Config("tier 1, 2 lanes", ("cpu",), 2, tier1=True, rtol=1e-4, atol=1e-4)
ALL_CONFIGS = CONFIGS + (TIER1,)


@contextlib.contextmanager
def configured(cfg):
    """Runs the block under `cfg`, then restores the lanes, policy and
    async_ops that were set before. Errors left pending by the block (an
    error mgpu defers, in a program) are dropped."""
    saved, saved_async = torch_mgpu.configuration(), torch_mgpu.async_ops()
    saved_hits, saved_trial = torch_mgpu._C._tier_compile_hits(), torch_mgpu._C._tier_trial()
    saved_at_call = torch_mgpu._C._at_call()
    saved_tolerance = dict(TOLERANCE)
    torch_mgpu.synchronize()
    try:
        TOLERANCE.update(rtol=cfg.rtol, atol=cfg.atol)
        torch_mgpu.configure(devices=list(cfg.devices), lanes_per_device=cfg.lanes_per_device,
                             policy=cfg.policy)
        torch_mgpu.set_async_ops(cfg.async_ops)
        if cfg.tier1:
            torch_mgpu.configure(compile=1)
            torch_mgpu._C._set_tier_trial(False)
        else:
            torch_mgpu.configure(compile=0)  # tier 0: eager's values bit for bit
        torch_mgpu.configure(at_call="on" if cfg.at_call else "off")
        yield
    finally:
        with contextlib.suppress(Exception):
            torch_mgpu.synchronize()
        if cfg.tier1:
            torch_mgpu.wait_for_compiles(600)
        torch_mgpu._C._set_tier_trial(saved_trial)
        torch_mgpu._C._set_at_call(saved_at_call)
        torch_mgpu.configure(compile=saved_hits)
        torch_mgpu.configure(**saved)
        TOLERANCE.update(saved_tolerance)
        torch_mgpu.set_async_ops(saved_async)


# Of the tier-1 runs that count (the second ones): the syncs that ran
# compiled code, and all their syncs (what a run compares in tier 1).
TIER1_SYNCS = {"compiled": 0, "all": 0}


def run_mgpu(prog, cfg):
    """`prog` run on mgpu as `cfg` has it (inside configured(cfg)): once,
    or for tier 1 once to make its graphs hot, then, compiled, again."""
    if not cfg.tier1:
        return run(prog, "mgpu")
    for _ in range(TIER1_WARM_UP):
        run(prog, "mgpu")
        with contextlib.suppress(Exception):
            torch_mgpu.synchronize()
    torch_mgpu.wait_for_compiles(600)
    before = torch_mgpu.stats()
    got = run(prog, "mgpu")
    after = torch_mgpu.stats()
    TIER1_SYNCS["compiled"] += after["tier1_runs"] - before["tier1_runs"]
    TIER1_SYNCS["all"] += after["syncs"] - before["syncs"]
    return got


# ---------------------------------------------------------------------------
# Programs

def _base_name(node):
    """The variable at the root of `v1[...]`, `v1.t().x`, `v1.grad`."""
    while isinstance(node, (ast.Subscript, ast.Attribute, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) and VAR.match(node.id) else None


# Functions that write some of their arguments in place without a trailing
# underscore: positions and keywords of those arguments.
WRITES_ARGUMENTS = {"batch_norm": ((1, 2), ("running_mean", "running_var")),
                    "instance_norm": ((1, 2), ("running_mean", "running_var"))}


def _written(tree):
    """Names whose tensors a statement may write in place: targets of
    `x[...] = `, `x.attr = ` and `x += `, receivers of `x.op_(...)`, tensors
    passed as out= and batch norm's running statistics."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(node, ast.AugAssign) or isinstance(t, (ast.Subscript, ast.Attribute)):
                    out.add(_base_name(t))
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr.endswith("_") and not f.attr.endswith("__"):
                out.add(_base_name(f.value))
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in WRITES_ARGUMENTS:
                positions, keywords = WRITES_ARGUMENTS[name]
                out.update(_base_name(node.args[k]) for k in positions if k < len(node.args))
                out.update(_base_name(kw.value) for kw in node.keywords if kw.arg in keywords)
    out |= _out_names(tree)
    out.discard(None)
    return out


def _out_names(tree):
    """The names passed as out= tensors."""
    return {n.id for node in ast.walk(tree) if isinstance(node, ast.Call)
            for kw in node.keywords if kw.arg == "out"
            for n in ast.walk(kw.value) if isinstance(n, ast.Name) and VAR.match(n.id)}


class Stmt:
    """One line of a program. `tag` names the kind of statement (its group
    when it mismatches); the names it stores, loads, may write in place and
    passes as out= come from its AST."""
    __slots__ = ("src", "tag", "stores", "loads", "writes", "outs")

    def __init__(self, src, tag):
        self.src, self.tag = src, tag
        self.stores, self.loads = set(), set()
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and VAR.match(node.id):
                (self.stores if isinstance(node.ctx, ast.Store) else self.loads).add(node.id)
        self.writes = _written(tree)
        self.outs = _out_names(tree)

    def __repr__(self):
        return f"Stmt({self.src!r}, {self.tag!r})"


class Program:
    """Statements, with each one's new names (`defs`: the names it binds
    first) and the earlier names it needs (`uses`: everything else it
    mentions, `x += y` rebinding x included)."""

    def __init__(self, seed, stmts, origin=None):
        self.seed, self.stmts = seed, list(stmts)
        # Each statement's index in the program generated from `seed`.
        self.origin = list(range(len(self.stmts))) if origin is None else list(origin)
        self.defs, self.uses = [], []
        defined = set()
        for st in self.stmts:
            new = sorted(st.stores - defined, key=lambda n: int(n[1:]))
            self.defs.append(new)
            self.uses.append((st.loads | st.stores) - set(new))
            defined.update(new)
        self.codes = [compile(st.src, f"<difffuzz seed={seed} stmt={i}>", "exec")
                      for i, st in enumerate(self.stmts)]
        self.reads = {name: compile(f"__value = __read({name})", f"<difffuzz seed={seed} read {name}>", "exec")
                      for names in self.defs for name in names}
        self.sync = compile("torch_mgpu.synchronize()", f"<difffuzz seed={seed} sync>", "exec")

    def keep(self, indices):
        """The program with only the statements at `indices`, less those
        that need a name no kept statement defines."""
        kept, origin, available = [], [], set()
        for i, st in enumerate(self.stmts):
            if i in indices and self.uses[i] <= available:
                kept.append(st)
                origin.append(self.origin[i])
                available.update(self.defs[i])
        return Program(self.seed, kept, origin)

    def source(self):
        return "\n".join(st.src for st in self.stmts)

    def __len__(self):
        return len(self.stmts)


def namespace(dev):
    return {"__builtins__": builtins, "torch": torch, "torch_mgpu": torch_mgpu, "dev": dev}


# ---------------------------------------------------------------------------
# Rendering Python literals

def lit(x):
    if isinstance(x, float):
        if math.isnan(x):
            return 'float("nan")'
        if math.isinf(x):
            return 'float("inf")' if x > 0 else 'float("-inf")'
        return repr(x)
    if isinstance(x, list):
        return "[" + ", ".join(lit(e) for e in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(lit(e) for e in x) + ("," if len(x) == 1 else "") + ")"
    return repr(x)


FLOAT_DTYPES = (torch.float32, torch.float64)
INT_DTYPES = (torch.int64, torch.int32, torch.uint8)


def kind_of(t):
    if t.dtype == torch.bool:
        return "bool"
    if t.is_complex():
        return "complex"
    if t.is_floating_point():
        return "float"
    return "int"


def castable(t, dtype):
    """Whether casting `t` to `dtype` is defined. Float -> integer casts of
    NaN, infinities or values out of the integer type's range are undefined
    in C++ (results differ between vectorized and scalar loops), so they are
    only generated for values that fit."""
    if kind_of(t) not in ("float", "complex") or dtype.is_floating_point or dtype.is_complex or \
            dtype == torch.bool:
        return True
    v = t.detach().resolve_conj().resolve_neg()
    if v.is_complex():
        v = torch.view_as_real(v)
    lo = 0 if dtype == torch.uint8 else -1e6
    return bool(torch.isfinite(v).all()) and bool((v > lo - 1).all()) and bool((v < 1e6).all()) \
        and (dtype != torch.uint8 or bool((v < 255).all()))


UNARY = {
    "float": ["abs", "neg", "exp", "sin", "cos", "tanh", "sqrt", "log", "sigmoid", "reciprocal", "rsqrt",
              "floor", "ceil", "round", "trunc", "frac", "erf", "expm1", "log1p", "relu", "sign", "square",
              "isnan", "isfinite", "nan_to_num", "exp2", "logical_not", "atan", "asin", "clone", "contiguous"],
    "int": ["abs", "neg", "sign", "square", "bitwise_not", "logical_not", "exp", "sqrt", "sin", "relu",
            "isnan", "clone", "contiguous", "sigmoid"],
    "bool": ["logical_not", "bitwise_not", "exp", "sin", "clone", "contiguous", "abs"],
    "complex": ["abs", "neg", "exp", "sin", "tanh", "sqrt", "log", "reciprocal", "sgn", "angle", "isnan",
                "conj_physical", "square", "clone"],
}
UNARY_WITH_ARGS = ["clamp(min=-0.5)", "clamp(-1, 1)", "clamp(max=0.25)", "pow(2)", "pow(0.5)",
                   "round(decimals=1)", "nan_to_num(posinf=9.0, neginf=-9.0)", "softmax(-1)",
                   "log_softmax(0)", "mul(2)", "add(1.5)", "div(3)"]
INFIX = ["+", "-", "*", "/", "//", "%", "**", "==", "<", ">=", "!=", "&", "|", "^"]
INFIX_WEIGHTS = [5, 3, 5, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
BINARY_FUNCS = ["torch.maximum", "torch.minimum", "torch.atan2", "torch.fmod", "torch.remainder",
                "torch.hypot", "torch.logical_and", "torch.logical_xor", "torch.eq", "torch.mul",
                "torch.true_divide", "torch.floor_divide", "torch.bitwise_and", "torch.fmax", "torch.xlogy",
                "torch.add", "torch.sub"]


# ---------------------------------------------------------------------------
# Generation

class Gen:
    """Builds one program, running each statement on CPU as it is chosen."""

    def __init__(self, seed, max_stmts):
        self.seed = seed
        self.rng = random.Random(seed)
        self.ns = namespace("cpu")
        self.stmts = []
        self.count = 0
        self.max_stmts = max_stmts
        self.generators = [
            (self.g_input, 1.0), (self.g_factory, 0.6), (self.g_chain, 0.8), (self.g_view, 2.0), (self.g_unary, 2.0),
            (self.g_binary, 2.5), (self.g_inplace, 2.0), (self.g_setitem, 1.0), (self.g_out, 1.5),
            (self.g_index, 1.5), (self.g_reduce, 2.0), (self.g_matmul, 1.0), (self.g_cast, 0.8),
            (self.g_misc, 0.8), (self.g_backward, 0.6), (self.g_autograd_grad, 0.4),
            (self.g_grad_read, 0.5), (self.g_grad_update, 0.3), (self.g_sync, 1.0),
            (self.g_default_dtype, 0.15), (self.g_error, 0.6),
        ]
        if seed >= NN_SEEDS:
            self.generators.append((self.g_nn, 1.5))

    # -- plumbing

    def build(self):
        r = self.rng
        target = r.randint(6, max(6, self.max_stmts))
        for _ in range(r.randint(1, 3)):
            self.g_input()
        gens, weights = zip(*self.generators)
        attempts = 0
        while len(self.stmts) < target and attempts < 10 * target:
            attempts += 1
            try:
                r.choices(gens, weights)[0]()
            except Exception:
                # A CPU value a generator did not expect (its own checks,
                # not a statement, raised): no statement this time.
                pass
        return Program(self.seed, self.stmts)

    def fresh(self, prefix="v"):
        name = f"{prefix}{self.count}"
        self.count += 1
        return name

    def emit(self, src, tag, expect_error=False):
        """Runs `src` on CPU; keeps it unless it raised unplanned (then
        sometimes). Returns whether it ran without raising."""
        st = Stmt(src, tag)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(compile(src, "<difffuzz generating>", "exec"), self.ns)
        except Exception:
            if expect_error or self.rng.random() < KEEP_UNPLANNED_ERROR:
                self.stmts.append(st)
            return False
        new = st.stores - set(n for s in self.stmts for n in s.stores)
        if any(isinstance(self.ns.get(n), torch.Tensor) and self.ns[n].numel() > LARGEST for n in new):
            for n in new:
                self.ns.pop(n, None)
            return False
        self.stmts.append(st)
        return True

    def peek(self, expr):
        """The CPU value of a side-effect-free expression, or None if it raises."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return eval(expr, self.ns)
        except Exception:
            return None

    def names(self, pred=None, prefix="v", large=False):
        return [n for n, x in self.ns.items()
                if n[0] == prefix and isinstance(x, torch.Tensor) and VAR.match(n)
                and (large or x.numel() <= SMALL) and (pred is None or pred(x))]

    def pick(self, pred=None, prefix="v", large=False):
        names = self.names(pred, prefix, large)
        return self.rng.choice(names) if names else None

    def val(self, name):
        return self.ns[name]

    def shape(self, ndim=None, large=0.0):
        r = self.rng
        if r.random() < large:
            # Larger values: vectorized and parallel loops, no dtype probe
            # past 16k elements.
            return r.choice([(r.randint(100, 20000),), (r.randint(20, 150), r.randint(20, 150)),
                             (r.randint(2, 4), r.randint(20, 80), r.randint(20, 80))])
        if ndim is None:
            ndim = r.choices([0, 1, 2, 3], [1, 4, 6, 3])[0]
        return tuple(0 if r.random() < 0.03 else r.choices([1, 2, 3, 4, 5], [2, 3, 3, 2, 1])[0]
                     for _ in range(ndim))

    def dtype(self):
        pool = [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64]
        weights = [8, 1.5, 3, 1, 0.4, 1.5, 1]
        if self.seed >= HALF_SEEDS:
            pool += [torch.float16, torch.bfloat16]
            weights += [1.5, 1.5]
        return self.rng.choices(pool, weights)[0]

    def element(self, dtype):
        r = self.rng
        if dtype == torch.bool:
            return r.random() < 0.5
        if dtype.is_complex:
            return complex(round(r.gauss(0, 1), 2), round(r.gauss(0, 1), 2))
        if dtype.is_floating_point:
            u = r.random()
            if u < 0.02:
                return math.nan
            if u < 0.04:
                return r.choice([math.inf, -math.inf])
            if u < 0.1:
                return 0.0
            return round(r.gauss(0, 1.5), 2)
        if dtype == torch.uint8:
            return r.randint(0, 9)
        return r.randint(-4, 5)

    def literal(self, shape, dtype):
        if not shape:
            return self.element(dtype)
        return [self.literal(shape[1:], dtype) for _ in range(shape[0])]

    def scalar(self, kind=None):
        """A Python number as source: a literal, or a number an earlier .item() gave."""
        r = self.rng
        known = [n for n, x in self.ns.items()
                 if n[0] == "s" and VAR.match(n) and type(x) in (int, float, bool)]
        if known and r.random() < 0.25:
            return r.choice(known)
        kind = kind or r.choices(["int", "float", "bool", "complex"], [4, 4, 1, 0.7])[0]
        if kind == "int":
            return str(r.randint(-3, 4))
        if kind == "float":
            return lit(r.choice([0.5, -1.5, 2.0, 0.25, 3.0, -0.75, round(r.uniform(-2, 2), 2)]))
        if kind == "bool":
            return r.choice(["True", "False"])
        return repr(complex(round(r.uniform(-1, 1), 1), round(r.uniform(-1, 1), 1)))

    def index_literal(self, n, count=None, dev=True, lo=None):
        """An int64 index tensor with entries in [-n, n) (or [lo, n))."""
        r = self.rng
        count = r.randint(1, 4) if count is None else count
        lo = -n if lo is None else lo
        values = [r.randint(lo, n - 1) for _ in range(count)]
        return f"torch.tensor({lit(values)}, device=dev)" if dev else f"torch.tensor({lit(values)})"

    def broadcastable(self, shape, to=None, prefix="v"):
        """Names of tensors whose shape broadcasts with `shape` (or into `to`)."""
        out = []
        for n in self.names(prefix=prefix):
            try:
                b = torch.broadcast_shapes(shape, self.val(n).shape)
            except RuntimeError:
                continue
            if to is None or tuple(b) == tuple(to):
                out.append(n)
        return out

    # -- values

    def g_input(self, shape=None, dtype=None, grad=None):
        r = self.rng
        name = self.fresh()
        dtype = dtype or self.dtype()
        shape = self.shape(large=0.05) if shape is None else tuple(shape)
        if grad is None:
            grad = dtype.is_floating_point and r.random() < 0.2
        if 0 < math.prod(shape) <= 8 and r.random() < 0.75:
            # A literal: the reproducer shows the values.
            infer = (dtype == torch.bool or (dtype == torch.int64 and r.random() < 0.5)
                     or (dtype == torch.float32 and r.random() < 0.3))
            dt = "" if infer else f", dtype={dtype}"
            vals = lit(self.literal(shape, dtype))
            src = (f"torch.tensor({vals}{dt}, device=dev)" if r.random() < 0.7
                   else f"torch.tensor({vals}{dt}).to(dev)")
        else:
            gen = f"generator=torch.Generator().manual_seed({r.randrange(1000)})"
            dims = lit(shape)
            if dtype.is_floating_point or dtype.is_complex:
                src = f"torch.randn({dims}, dtype={dtype}, {gen}).to(dev)"
            elif dtype == torch.bool:
                src = f"torch.randint(0, 2, {dims}, {gen}).bool().to(dev)"
            else:
                lo = 0 if dtype == torch.uint8 else -4
                src = f"torch.randint({lo}, 5, {dims}, dtype={dtype}, {gen}).to(dev)"
        if grad:
            src += ".requires_grad_()"
        self.emit(f"{name} = {src}", "input")
        return name if name in self.ns else None

    def g_factory(self):
        r = self.rng
        shape = lit(self.shape())
        x = self.pick()
        n = r.randint(1, 6)
        options = [
            f"torch.zeros({shape}, device=dev)",
            f"torch.ones({shape}, dtype={self.dtype()}, device=dev)",
            f"torch.full({shape}, {self.scalar()}, device=dev)",
            f"torch.arange({n}, device=dev)",
            f"torch.arange({r.randint(-3, 0)}, {n}, {r.choice([0.5, 0.75, 1.5])}, device=dev)",
            f"torch.linspace(-1, 1, {n}, device=dev)",
            f"torch.eye({n}, device=dev)",
            f"torch.tensor({self.scalar()}, device=dev)",
            f"torch.empty({shape}, device=dev).fill_({self.scalar('float')})",
        ]
        if x:
            options += [f"torch.zeros_like({x})", f"torch.ones_like({x}, dtype={self.dtype()})",
                        f"torch.full_like({x}, {self.scalar()})", f"{x}.new_zeros({shape})",
                        f"{x}.new_full({shape}, {self.scalar()})", f"{x}.new_tensor({self.scalar()})"]
        src = r.choice(options)
        self.emit(f"{self.fresh()} = {src}", "factory." + re.match(r"(?:torch\.)?(?:v\d+\.)?(\w+)", src).group(1))

    # -- views

    def slice_expr(self, name):
        """`name[...]` with slices, steps, integers, None and Ellipsis."""
        r = self.rng
        shape = self.val(name).shape
        nd = len(shape)
        if nd == 0:
            return f"{name}[{r.choice(['None', '...', '()'])}]"
        k = r.randint(1, nd)
        trailing = r.random() < 0.2 and k < nd
        dims = range(nd - k, nd) if trailing else range(k)
        parts = []
        for d in dims:
            n = shape[d]
            u = r.random()
            if u < 0.35:
                step = r.choice([2, 3])
                start = r.randint(0, max(n - 1, 0))
                parts.append(f"{start}::{step}" if start else f"::{step}")
            elif u < 0.55:
                a = r.randint(-n, n)
                b = r.randint(-n, n)
                parts.append(f"{a}:{b}" if r.random() < 0.5 else f"{a}:")
            elif u < 0.7 and n > 0:
                parts.append(str(r.randint(-n, n - 1)))
            else:
                parts.append(":")
            if r.random() < 0.1:
                parts.append("None")
        if trailing:
            parts.insert(0, "...")
        return f"{name}[{', '.join(parts)}]"

    def view_expr(self, name):
        """A random view of `name`: (expression, op name)."""
        r = self.rng
        x = self.val(name)
        nd, shape = x.dim(), tuple(x.shape)
        opts = [(self.slice_expr(name), "slice")] * 3
        if nd <= 2:
            opts += [(f"{name}.t()", "t")] * 3
        if nd >= 2:
            a, b = r.sample(range(nd), 2)
            perm = list(range(nd))
            r.shuffle(perm)
            opts += [(f"{name}.transpose({a}, {b - nd if r.random() < 0.3 else b})", "transpose")] * 2
            opts += [(f"{name}.mT", "mT"), (f"{name}.permute({lit(tuple(perm))})", "permute"),
                     (f"{name}.diagonal()", "diagonal"), (f"{name}.movedim(0, -1)", "movedim")]
        if nd >= 1:
            d = r.randrange(nd)
            n = shape[d]
            start = r.randint(0, n)
            opts += [(f"{name}.narrow({d}, {start}, {r.randint(0, n - start)})", "narrow"),
                     (f"{name}.flatten()", "flatten"), (f"{name}.view(-1)", "view"),
                     (f"{name}.unfold({d}, {min(n, r.randint(1, 2))}, {r.randint(1, 2)})", "unfold")]
            if n > 0:
                opts.append((f"{name}.select({d}, {r.randint(-n, n - 1)})", "select"))
            # A reshape to another factorization of the element count.
            numel = x.numel()
            if numel > 0:
                f = r.choice([k for k in range(1, numel + 1) if numel % k == 0])
                target = r.choice([(f, numel // f), (numel // f, -1), (1, numel, 1), (-1,)])
                opts += [(f"{name}.view({lit(target)})", "view"), (f"{name}.reshape({lit(target)})", "reshape")]
        # expand: size-1 dims grow, new leading dims appear.
        new = [r.choice([1, 2, 3]) if s == 1 else (-1 if r.random() < 0.3 else s) for s in shape]
        if r.random() < 0.4:
            new.insert(0, r.choice([1, 2, 3]))
        opts += [(f"{name}.expand({lit(tuple(new))})", "expand"),
                 (f"{name}.unsqueeze({r.randint(-nd - 1, nd)})", "unsqueeze"),
                 (f"{name}.squeeze()" if nd == 0 or r.random() < 0.5 else f"{name}.squeeze({r.randrange(nd)})",
                  "squeeze"),
                 (f"{name}.detach()", "detach"), (f"{name}[None]", "slice")]
        if x.is_complex():
            opts += [(f"{name}.real", "real"), (f"{name}.imag", "imag"), (f"{name}.conj()", "conj"),
                     (f"torch.view_as_real({name})", "view_as_real")]
        reinterpret = {torch.int32: torch.float32, torch.float32: torch.int32,
                       torch.int64: torch.float64, torch.float64: torch.int64}
        if x.dtype in reinterpret and (not x.is_floating_point() or not bool(x.isnan().any())):
            # Bit views of floats only without NaN (NaN payloads and signs may
            # legitimately differ between loops).
            opts.append((f"{name}.view({reinterpret[x.dtype]})", "view_dtype"))
        if self.strided_ok(x) and r.random() < 0.5:
            opts.append((self.as_strided_expr(name, x.numel()), "as_strided"))
        return r.choice(opts)

    @staticmethod
    def strided_ok(x):
        """as_strided only over a whole, dense tensor, so that both sides see
        the same storage."""
        return (x.numel() >= 2 and x.is_contiguous() and x.storage_offset() == 0
                and x.untyped_storage().nbytes() == x.numel() * x.element_size())

    def as_strided_expr(self, name, numel):
        r = self.rng
        while True:
            nd = r.randint(1, 2)
            size = [r.randint(1, 3) for _ in range(nd)]
            stride = [r.randint(0, 2) for _ in range(nd)]
            offset = r.randint(0, 2)
            if offset + sum((s - 1) * st for s, st in zip(size, stride)) < numel:
                return f"{name}.as_strided({lit(tuple(size))}, {lit(tuple(stride))}, {offset})"

    def g_view(self):
        x = self.pick(large=True)
        if x is None:
            return
        expr, op = self.view_expr(x)
        self.emit(f"{self.fresh()} = {expr}", "view." + op)

    def operand(self, name, view_p=0.4):
        """`name`, or (often) a view of it: elementwise ops on transposed,
        strided or broadcast inputs."""
        if self.rng.random() < view_p:
            return self.view_expr(name)[0]
        return name

    # -- elementwise

    def g_unary(self):
        r = self.rng
        x = self.pick(large=True)
        if x is None:
            return
        expr = self.operand(x, 0.5)
        kind = kind_of(self.val(x))
        if r.random() < 0.2:
            call = r.choice(UNARY_WITH_ARGS)
            op = call.split("(")[0]
        else:
            op = r.choice(UNARY[kind] if r.random() < 0.9 else UNARY["float"])
            call = f"{op}()"
        if r.random() < 0.3 and op not in ("contiguous",):
            inner = call[len(op) + 1:-1]
            src = f"torch.{op}({expr}{', ' + inner if inner else ''})"
        else:
            src = f"{expr}.{call}"
        self.emit(f"{self.fresh()} = {src}", "unary." + op)

    def g_binary(self):
        r = self.rng
        a = self.pick()
        if a is None:
            return
        ea = self.operand(a, 0.35)
        va = self.peek(ea)
        if not isinstance(va, torch.Tensor):
            return
        u = r.random()
        hosts = self.names(lambda t: t.dim() == 0, prefix="h")
        if u < 0.3:
            eb = self.scalar()
        elif u < 0.33 and hosts:
            eb = r.choice(hosts)   # a 0-dim host tensor: eager allows it beside device tensors
        elif u < 0.4:
            eb = self.operand(a, 0.8)
        else:
            cands = self.broadcastable(tuple(va.shape))
            eb = self.operand(r.choice(cands), 0.2) if cands and r.random() < 0.9 else self.operand(
                self.pick() or a, 0.2)
        if r.random() < 0.7:
            op = r.choices(INFIX, INFIX_WEIGHTS)[0]
            if r.random() < 0.25 and not VAR.match(eb.split("[")[0].split(".")[0]):
                src = f"{eb} {op} {ea}"   # number on the left: rsub, rtruediv, rpow
            else:
                src = f"{ea} {op} {eb}"
            tag = "binary" + op
        else:
            fn = r.choice(BINARY_FUNCS)
            extra = f", alpha={self.scalar(r.choice(['int', 'float']))}" if fn in ("torch.add", "torch.sub") and \
                r.random() < 0.5 else ""
            src = f"{fn}({ea}, {eb}{extra})"
            tag = "binary." + fn.split(".")[1]
        self.emit(f"{self.fresh()} = {src}", tag)

    def g_chain(self):
        """Consecutive elementwise arithmetic on same-size contiguous float
        tensors: what mgpu's pointwise fusion runs as one pass, its
        intermediates (unless read elsewhere) never materialized."""
        r = self.rng
        a = self.pick(lambda x: x.dtype in FLOAT_DTYPES and x.dim() >= 1 and x.is_contiguous(), large=True)
        if a is None or r.random() < 0.3:
            a = self.g_input(shape=self.shape(r.randint(1, 2), large=0.3), dtype=r.choice(FLOAT_DTYPES))
            if a is None:
                return
        va = self.val(a)
        same = self.names(lambda x: x.dtype == va.dtype and x.shape == va.shape and x.is_contiguous(), large=True)
        cur = a
        for _ in range(r.randint(2, 6)):
            op = r.choice(["+", "-", "*", "/", "neg", "relu", "inplace"])
            other = r.choice(same) if same and r.random() < 0.5 else self.scalar(r.choice(["int", "float"]))
            if op == "inplace":
                self.emit(f"{cur}.{r.choice(['add_', 'mul_', 'sub_'])}({other})", "chain.inplace")
                continue
            if op == "neg":
                src = r.choice([f"-{cur}", f"{cur}.neg()"])
            elif op == "relu":
                src = r.choice([f"{cur}.relu()", f"torch.relu({cur})"])
            elif not VAR.match(other) and r.random() < 0.3:
                src = f"{other} {op} {cur}"
            else:
                src = f"{cur} {op} {other}"
            new = self.fresh()
            if not self.emit(f"{new} = {src}", "chain" + (op if len(op) == 1 else "." + op)):
                return
            cur = new
            same.append(new)

    def g_inplace(self):
        r = self.rng
        t = self.pick(large=True)
        if t is None:
            return
        vt = self.val(t)
        shape = tuple(vt.shape)
        same = self.broadcastable(shape, to=shape)
        other = self.operand(r.choice(same), 0.2) if same and r.random() < 0.9 else (self.pick() or t)
        rhs = self.scalar() if r.random() < 0.4 else other
        bools = [n for n in same if self.val(n).dtype == torch.bool]
        mask = (r.choice(bools) if bools and r.random() < 0.5 else
                f"{t} > 0" if not vt.is_complex() else f"{t}.abs() > 1")
        lo = r.choice(["-1", "-0.5", "0", "1"])
        options = [
            (f"{t}.add_({rhs})", "add_"), (f"{t}.add_({other}, alpha={self.scalar('int')})", "add_"),
            (f"{t}.sub_({rhs})", "sub_"), (f"{t}.mul_({rhs})", "mul_"), (f"{t}.div_({rhs})", "div_"),
            (f"{t}.clamp_({lo}, {r.choice(['1', '2', '0.5'])})", "clamp_"), (f"{t}.clamp_(min={lo})", "clamp_"),
            (f"{t}.fill_({self.scalar()})", "fill_"), (f"{t}.zero_()", "zero_"), (f"{t}.neg_()", "neg_"),
            (f"{t}.abs_()", "abs_"), (f"{t}.relu_()", "relu_"), (f"{t}.exp_()", "exp_"),
            (f"{t}.masked_fill_({mask}, {self.scalar()})", "masked_fill_"),
            (f"{t}.lerp_({other}, 0.5)", "lerp_"), (f"{t}.addcmul_({other}, {other}, value=0.5)", "addcmul_"),
            (f"{t} += {rhs}", "iadd"), (f"{t} *= {rhs}", "imul"),
        ]
        # copy_ from any dtype that broadcasts (float -> integer only where
        # defined), host copies included.
        hosts = self.broadcastable(shape, to=shape, prefix="h")
        srcs = [n for n in same + hosts if castable(self.val(n), vt.dtype)]
        if srcs:
            options += [(f"{t}.copy_({self.operand(r.choice(srcs), 0.3)})", "copy_")] * 3
        if vt.dim() <= 2 and r.random() < 0.3:
            options.append((f"{t}.t_()", "t_"))
        if r.random() < 0.2:
            options.append((f"{t}.unsqueeze_(0)", "unsqueeze_"))
        if vt.is_leaf and (vt.is_floating_point() or vt.is_complex()) and not vt.requires_grad:
            options.append((f"{t}.requires_grad_()", "requires_grad_"))
        src, op = r.choice(options)
        self.emit(src, "inplace." + op)

    def g_setitem(self):
        r = self.rng
        t = self.pick(lambda x: x.dim() >= 1)
        if t is None:
            return
        vt = self.val(t)
        shape = tuple(vt.shape)
        n = shape[0]
        u = r.random()
        if u < 0.3:
            idx, op = self.slice_expr(t)[len(t) + 1:-1], "slice"
        elif u < 0.55:
            bools = [b for b in self.names(lambda x: x.dtype == torch.bool and 1 <= x.dim() <= len(shape))
                     if tuple(self.val(b).shape) == shape[:self.val(b).dim()]]
            idx = r.choice(bools) if bools and r.random() < 0.5 else (
                f"{t} > 0" if not vt.is_complex() else f"{t}.abs() > 1")
            op = "mask"
        elif u < 0.8 and n > 0:
            idx, op = self.index_literal(n, dev=r.random() < 0.85), "index"
        elif n > 0:
            # index_put_, index_fill_, index_add_, index_copy_ along a dim.
            d = r.randrange(vt.dim())
            m = shape[d]
            if m == 0:
                return
            ids = r.sample(range(m), r.randint(1, m))
            idx = f"torch.tensor({lit(ids)}, device=dev)"
            src_shape = shape[:d] + (len(ids),) + shape[d + 1:]
            src = self.g_input(shape=src_shape, dtype=vt.dtype, grad=False) if r.random() < 0.7 else None
            options = [(f"{t}.index_fill_({d}, {idx}, {self.scalar()})", "index_fill_")]
            if src:
                options += [(f"{t}.index_add_({d}, {idx}, {src})", "index_add_"),
                            (f"{t}.index_copy_({d}, {idx}, {src})", "index_copy_")]
            if d == 0:
                accumulate = r.random() < 0.5
                dup = ids + ids[:1] if accumulate else ids   # duplicates only where they add up
                vals = f"torch.ones({len(dup)}, dtype={vt.dtype}, device=dev)"
                options.append((f"{t}.index_put_((torch.tensor({lit(dup)}, device=dev),), {vals}"
                                f"{', accumulate=True' if accumulate else ''})", "index_put_"))
            src_, op = r.choice(options)
            self.emit(src_, "setitem." + op)
            return
        else:
            return
        target = self.peek(f"{t}[{idx}]")
        if not isinstance(target, torch.Tensor):
            return
        fits = self.broadcastable(tuple(target.shape), to=tuple(target.shape))
        value = r.choice(fits) if fits and r.random() < 0.4 else self.scalar()
        if r.random() < 0.2:
            self.emit(f"{t}[{idx}] += {self.scalar('int')}", "setitem." + op)
        else:
            self.emit(f"{t}[{idx}] = {value}", "setitem." + op + self.zero_dim_tag(t, value))

    def zero_dim_tag(self, t, value):
        """ZERO_DIM where `t[...] = value` meets the documented difference of
        a 0-dim tensor value: PyTorch's indexing copies it (copy_) where it
        is on the device and fills with it (fill_) where it is on the host.
        A copy refuses a value that overlaps the written elements (as on
        CUDA), and autograd sees a copy's cast: the value's gradient (a real
        value into a complex tensor, a float one into an integer tensor)
        differs from a fill's."""
        if value not in self.ns:
            return ""
        vt, vv = self.val(t), self.val(value)
        if not isinstance(vv, torch.Tensor) or vv.dim() != 0:
            return ""
        try:
            shared = (vv.untyped_storage().nbytes() > 0
                      and vv.untyped_storage().data_ptr() == vt.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            shared = False  # a tensor without storage (autograd's zero tensors)
        return ZERO_DIM if shared or (vv.requires_grad and vv.dtype != vt.dtype) else ""

    # -- out=

    def g_out(self):
        r = self.rng
        a = self.pick()
        if a is None:
            return
        va = self.val(a)
        nd = va.dim()
        d = r.randrange(nd) if nd else 0
        same = self.broadcastable(tuple(va.shape))
        b = r.choice(same) if same else a
        ops = [("add", f"torch.add({a}, {b}, ", 3), ("mul", f"torch.mul({a}, {self.scalar()}, ", 2),
               ("abs", f"torch.abs({a}, ", 1), ("exp", f"torch.exp({a}, ", 1), ("neg", f"torch.neg({a}, ", 1),
               ("clamp", f"torch.clamp({a}, -1, 1, ", 1), ("sum", f"torch.sum({a}, {d}, ", 2),
               ("mean", f"torch.mean({a}, {d}, ", 1), ("amax", f"torch.amax({a}, {d}, ", 1),
               ("cumsum", f"torch.cumsum({a}, {d}, ", 1), ("maximum", f"torch.maximum({a}, {b}, ", 1),
               ("pow", f"torch.pow({a}, 2, ", 1), ("argmax", f"torch.argmax({a}, {d}, ", 1),
               ("sub", f"torch.sub({a}, {b}, ", 1), ("where", f"torch.where({a} > 0, {a}, {b}, ", 1)]
        if nd == 2:
            ops += [("mm", f"torch.mm({a}, {a}.t(), ", 2), ("matmul", f"torch.matmul({a}.t(), {a}, ", 1)]
        if nd >= 1 and va.shape[0] > 0:
            ops += [("index_select", f"torch.index_select({a}, 0, {self.index_literal(va.shape[0], lo=0)}, ", 1),
                    ("cat", f"torch.cat([{a}, {a}], {d}, ", 1)]
        tuple_ops = [("sort", f"torch.sort({a}, dim={d}, stable=True, "), ("max", f"torch.max({a}, {d}, "),
                     ("topk", f"torch.topk({a}, {min(2, va.shape[d]) if nd else 1}, {d}, ")]
        if r.random() < 0.15:
            op, call = r.choice(tuple_ops)
            res = self.peek(call + ")")
            if res is None:
                return
            outs = [self.out_tensor(x) for x in res]
            if outs[0] is None or outs[1] is None:
                return
            v1, v2 = self.fresh(), self.fresh()
            self.emit(f"{v1}, {v2} = {call}out=({outs[0]}, {outs[1]}))", self.out_tag(op, call, outs))
            return
        op, call, _ = r.choices(ops, [w for *_, w in ops])[0]
        res = self.peek(call + ")")
        if not isinstance(res, torch.Tensor):
            return
        out = self.out_tensor(res)
        if out is None:
            return
        self.emit(f"{self.fresh()} = {call}out={out})", self.out_tag(op, call, [out]))

    def out_tag(self, op, call, outs):
        """The tag of an out= call of `op`: marked ALIASED where an out=
        tensor shares memory with an input or with another out= tensor
        (eager's result then depends on its kernel's order of reads and
        writes: `torch.max(x, 0, out=(v, v))`, seed 1214903). An empty
        storage counts: the out= tensor resized is then the input resized
        (seed 965658)."""
        def storage(name):
            t = self.val(name)
            if torch._is_zerotensor(t):
                # No storage: no out= call with one (as before, so that a
                # seed makes the program it made then).
                raise ValueError(f"{name} is a zero tensor")
            return t.untyped_storage()._cdata
        inputs = {storage(n) for n in set(re.findall(r"\b[vhs]\d+\b", call)) if n in self.ns}
        out_storages = [storage(n) for n in outs]
        aliased = any(o in inputs for o in out_storages) or len(set(out_storages)) < len(out_storages)
        return "out." + op + (ALIASED if aliased else "")

    def out_tensor(self, res):
        """A name for an out= tensor for result `res`: right, non-contiguous,
        wrong-sized, empty, wrong-dtype, or an existing value."""
        r = self.rng
        shape, dtype = tuple(res.shape), res.dtype
        u = r.random()
        if u < 0.1:
            return self.pick()      # an existing value, resized or not
        if u < 0.25 and dtype != torch.bool:
            # Another dtype: a cast eager allows, or one it refuses.
            dtype = r.choice([torch.float64, torch.int64, torch.bool, torch.complex64, torch.float32])
        u = r.random()
        if u < 0.35:
            src = f"torch.zeros({lit(shape)}, dtype={dtype}, device=dev)"
        elif u < 0.6 and len(shape) >= 2:
            rev = shape[:-2] + (shape[-1], shape[-2])
            src = f"torch.zeros({lit(rev)}, dtype={dtype}, device=dev).mT"
        elif u < 0.6 and len(shape) == 1:
            src = f"torch.zeros({2 * shape[0]}, dtype={dtype}, device=dev)[::2]"
        elif u < 0.75:
            src = f"torch.zeros(0, dtype={dtype}, device=dev)"
        elif u < 0.9:
            wrong = (math.prod(shape) + r.randint(1, 3),) if r.random() < 0.5 else shape + (2,)
            src = f"torch.zeros({lit(wrong)}, dtype={dtype}, device=dev)"
        else:
            wrong = (r.randint(1, 3), r.randint(2, 4))
            src = f"torch.zeros({lit(wrong[::-1])}, dtype={dtype}, device=dev).t()"   # wrong size and strided
        name = self.fresh()
        return name if self.emit(f"{name} = {src}", "out_tensor") else None

    # -- indexing

    def g_index(self):
        r = self.rng
        a = self.pick(lambda x: x.dim() >= 1)
        if a is None:
            return
        va = self.val(a)
        shape = tuple(va.shape)
        nd, n = len(shape), shape[0]
        kind = kind_of(va)
        options = []
        if n > 0:
            idx = self.index_literal(n, dev=r.random() < 0.85)
            options += [(f"{a}[{idx}]", "tensor"), (f"{a}.index_select(0, {self.index_literal(n, lo=0)})",
                                                      "index_select"),
                        (f"{a}[{lit([r.randint(-n, n - 1) for _ in range(r.randint(1, 3))])}]", "list")]
            ints = [i for i in self.names(lambda x: kind_of(x) == "int" and x.dim() <= 2)]
            if ints:
                options.append((f"{a}[{r.choice(ints)} % {n}]", "tensor"))
        if nd >= 2 and shape[1] > 0:
            idx1 = self.index_literal(shape[1])
            options += [(f"{a}[:, {idx1}]", "tensor"), (f"{a}[..., {self.index_literal(shape[-1])}]", "tensor")
                        if shape[-1] > 0 else (f"{a}[..., 0:1]", "slice")]
            if n > 0:
                k = r.randint(1, 3)
                options.append((f"{a}[{self.index_literal(n, k)}, {self.index_literal(shape[1], k)}]", "tensor"))
        bools = [b for b in self.names(lambda x: x.dtype == torch.bool and 1 <= x.dim() <= nd)
                 if tuple(self.val(b).shape) == shape[:self.val(b).dim()]]
        mask = r.choice(bools) if bools and r.random() < 0.5 else (
            f"{a} > 0" if kind != "complex" else f"{a}.abs() > 1")
        options += [(f"{a}[{mask}]", "mask"), (f"{a}.masked_select({mask})", "masked_select"),
                    (f"{a}.nonzero()", "nonzero"), (f"torch.where({mask}, {a}, {self.scalar()})", "where"),
                    (f"{a}.unique()", "unique"), (f"{a}.flatten().take({self.index_literal(va.numel())})", "take")
                    if va.numel() else (f"{a}.nonzero()", "nonzero")]
        # gather / take_along_dim: an index no larger than the input beside dim d.
        d = r.randrange(nd)
        if shape[d] > 0:
            ishape = [r.randint(1, s) if s else 0 for s in shape]
            ishape[d] = r.randint(1, 3)
            values = torch.tensor(self.literal(tuple(ishape), torch.int64), dtype=torch.int64) % shape[d]
            gidx = f"torch.tensor({lit(values.tolist())}, device=dev)"
            options += [(f"torch.gather({a}, {d}, {gidx})", "gather")] * 2
            if tuple(ishape) == shape[:d] + (ishape[d],) + shape[d + 1:]:
                options.append((f"torch.take_along_dim({a}, {gidx}, {d})", "take_along_dim"))
        src, op = r.choice(options)
        if op == "unique" and r.random() < 0.5:
            v1, v2 = self.fresh(), self.fresh()
            self.emit(f"{v1}, {v2} = torch.unique({a}, return_counts=True)", "index.unique")
            return
        self.emit(f"{self.fresh()} = {src}", "index." + op)

    # -- reductions, matmul, casts

    def g_reduce(self):
        r = self.rng
        a = self.pick(large=True)
        if a is None:
            return
        va = self.val(a)
        nd = va.dim()
        e = self.operand(a, 0.3)
        ve = self.peek(e)
        if not isinstance(ve, torch.Tensor):
            return
        nd = ve.dim()
        d = r.randint(-nd, nd - 1) if nd else r.choice([0, -1])
        kd = ", keepdim=True" if r.random() < 0.3 else ""
        size = ve.shape[d] if nd else 1
        k = r.randint(1, max(size, 1))
        options = [
            (f"{e}.sum()", "sum"), (f"{e}.sum({d}{kd})", "sum"), (f"{e}.sum(dtype=torch.float64)", "sum"),
            (f"{e}.mean({d}{kd})", "mean"), (f"{e}.mean()", "mean"), (f"{e}.prod({d})", "prod"),
            (f"{e}.amax({d}{kd})", "amax"), (f"{e}.amin()", "amin"), (f"{e}.argmax()", "argmax"),
            (f"{e}.argmax({d}{kd})", "argmax"), (f"{e}.argmin({d})", "argmin"), (f"{e}.cumsum({d})", "cumsum"),
            (f"{e}.cumprod({d})", "cumprod"), (f"{e}.any()", "any"), (f"{e}.all({d})", "all"),
            (f"{e}.std({d})", "std"), (f"{e}.var()", "var"), (f"{e}.norm()", "norm"),
            (f"{e}.logsumexp({d})", "logsumexp"), (f"{e}.count_nonzero({d})", "count_nonzero"),
            (f"{e}.argsort(dim={d}, stable=True)", "argsort"), (f"torch.softmax({e}, {d})", "softmax"),
        ]
        if nd >= 2:
            options.append((f"{e}.sum(({0}, {nd - 1}))", "sum"))
        pair = [(f"{e}.sort(dim={d}, descending={r.random() < 0.3}, stable=True)", "sort"),
                (f"{e}.max({d}{kd})", "max"), (f"{e}.min({d})", "min"), (f"{e}.topk({k}, {d})", "topk"),
                (f"{e}.kthvalue({k}, {d})", "kthvalue"), (f"torch.cummax({e}, {d})", "cummax")]
        if r.random() < 0.3:
            src, op = r.choice(pair)
            v1, v2 = self.fresh(), self.fresh()
            self.emit(f"{v1}, {v2} = {src}", "reduce." + op)
        else:
            src, op = r.choice(options)
            self.emit(f"{self.fresh()} = {src}", "reduce." + op)

    def g_matmul(self):
        r = self.rng
        a = self.pick(lambda x: 1 <= x.dim() <= 3)
        if a is None:
            return
        va = self.val(a)
        shape = tuple(va.shape)
        k = shape[-1]
        partners = [n for n in self.names(lambda x: 1 <= x.dim() <= 3)
                    if self.val(n).shape[-2 if self.val(n).dim() >= 2 else -1] == k]
        if partners and r.random() < 0.6:
            b = r.choice(partners)
            if r.random() < 0.2 and self.val(b).dtype != va.dtype:
                b = f"{b}.to({va.dtype})"
        elif va.dim() >= 2 and r.random() < 0.6:
            b = r.choice([f"{a}.mT", f"{a}.transpose(-1, -2)"]) if r.random() < 0.7 else f"{a}.mT.contiguous()"
        else:
            bshape = (k,) if r.random() < 0.3 else (k, r.randint(1, 4))
            b = self.g_input(shape=bshape, dtype=va.dtype if r.random() < 0.9 else None)
            if b is None:
                return
        forms = [(f"{a} @ {b}", "@"), (f"torch.matmul({a}, {b})", "matmul")]
        vb = self.peek(b)
        if va.dim() == 2 and isinstance(vb, torch.Tensor) and vb.dim() == 2:
            forms += [(f"torch.mm({a}, {b})", "mm"), (f"torch.einsum('ij,jk->ik', {a}, {b})", "einsum")]
            c = self.pick(lambda x: x.dim() <= 2)
            if c:
                forms.append((f"torch.addmm({c}, {a}, {b}, beta=0.5, alpha=2)", "addmm"))
        if va.dim() == 2 and isinstance(vb, torch.Tensor) and vb.dim() == 1:
            forms.append((f"torch.mv({a}, {b})", "mv"))
        if va.dim() == 1 and r.random() < 0.3:
            forms.append((f"torch.outer({a}, {a})", "outer"))
        if va.dim() >= 2 and r.random() < 0.3:
            forms.append((f"{a}.mT @ {a}", "@"))
        src, op = r.choice(forms)
        self.emit(f"{self.fresh()} = {src}", "matmul." + op)

    def g_cast(self):
        r = self.rng
        a = self.pick(large=True)
        if a is None:
            return
        va = self.val(a)
        target = self.dtype()
        if not castable(va, target):
            target = r.choice(FLOAT_DTYPES + (torch.complex64,) +
                              ((torch.float16, torch.bfloat16) if self.seed >= HALF_SEEDS else ()))
        b = self.pick()
        options = [(f"{a}.to({target})", "to"), (f"{a}.type({target})", "type")]
        if castable(va, torch.int64):
            options += [(f"{a}.long()", "long"), (f"{a}.int()", "int")]
        options += [(f"{a}.float()", "float"), (f"{a}.double()", "double"), (f"{a}.bool()", "bool"),
                    (f"{a}.to(dev, {target})", "to"), (f"{self.operand(a, 0.8)}.to({target})", "to")]
        if b and castable(va, self.val(b).dtype):
            options += [(f"{a}.to({b})", "to"), (f"{a}.type_as({b})", "type_as")]
        src, op = r.choice(options)
        self.emit(f"{self.fresh()} = {src}", "cast." + op)

    def g_misc(self):
        r = self.rng
        a = self.pick()
        if a is None:
            return
        va = self.val(a)
        nd, shape = va.dim(), tuple(va.shape)
        d = r.randrange(nd) if nd else 0
        others = [n for n in self.names(lambda x: x.dim() == nd)
                  if all(s == t for i, (s, t) in enumerate(zip(self.val(n).shape, shape)) if i != d)]
        b = r.choice(others) if others else a
        options = [(f"{a}.clone()", "clone"), (f"{a}.contiguous()", "contiguous"),
                   (f"torch.stack([{a}, {a} * 2])", "stack")]
        if nd:
            options += [(f"torch.cat([{a}, {b}], {d})", "cat"), (f"torch.cat([{a}, {self.operand(b, 0.5)}], {d})",
                                                                  "cat"),
                        (f"{a}.flip({d})", "flip"), (f"{a}.roll({r.randint(-2, 2)}, {d})", "roll"),
                        (f"{a}.repeat({lit(tuple(r.randint(1, 2) for _ in range(nd)))})", "repeat"),
                        (f"{a}.repeat_interleave(2, {d})", "repeat_interleave"),
                        (f"{a}.expand({lit((2,) + shape)}).contiguous()", "expand_contiguous")]
        if nd == 2:
            options += [(f"torch.tril({a})", "tril"), (f"{a}.triu(1)", "triu"),
                        (f"{a}.t().contiguous()", "t_contiguous")]
        src, op = r.choice(options)
        self.emit(f"{self.fresh()} = {src}", "misc." + op)

    # -- torch.nn.functional

    def rand_expr(self, shape, dtype, positive=False):
        """A seeded random tensor on the program's device (the same values
        on both sides)."""
        gen = f"generator=torch.Generator().manual_seed({self.rng.randrange(1000)})"
        src = f"torch.{'rand' if positive else 'randn'}({lit(tuple(shape))}, dtype={dtype}, {gen}).to(dev)"
        return f"({src} + 0.5)" if positive else src

    def param(self, shape, dtype):
        """A weight: sometimes a named leaf that requires grad (a parameter
        whose gradient backward computes while the input may need none),
        else a random tensor written in the statement."""
        if self.rng.random() < 0.35:
            name = self.g_input(shape=shape, dtype=dtype, grad=True)
            if name is not None:
                return name
        return self.rand_expr(shape, dtype)

    def g_nn(self):
        r = self.rng
        a = self.pick(lambda x: x.dtype in FLOAT_DTYPES and x.dim() >= 1, large=True)
        if a is None or r.random() < 0.4:
            # Batches of channels: (N, C, L) or (N, C, H, W).
            shape = (r.randint(1, 3), r.randint(1, 4)) + tuple(r.randint(2, 6) for _ in range(r.randint(1, 2)))
            a = self.g_input(shape=shape, dtype=r.choice(FLOAT_DTYPES), grad=r.random() < 0.2)
            if a is None:
                return
        e = self.operand(a, 0.3)
        ve = self.peek(e)
        if not isinstance(ve, torch.Tensor) or ve.dtype not in FLOAT_DTYPES:
            return
        nd, shape, dt = ve.dim(), tuple(ve.shape), ve.dtype
        c = shape[1] if nd >= 2 else shape[0]
        F = "torch.nn.functional"
        features = r.randint(1, 5)
        # (source, tag); a source is a function, called for the chosen one
        # only (weights it names are made then).
        options = [
            (lambda: f"{F}.gelu({e})", "gelu"), (lambda: f"{F}.gelu({e}, approximate='tanh')", "gelu"),
            (lambda: f"{F}.silu({e})", "silu"), (lambda: f"{F}.elu({e}, alpha=0.7)", "elu"),
            (lambda: f"{F}.leaky_relu({e}, 0.2)", "leaky_relu"), (lambda: f"{F}.hardtanh({e}, -0.5, 0.5)", "hardtanh"),
            (lambda: f"{F}.softplus({e}, beta=2.0)", "softplus"), (lambda: f"{F}.mish({e})", "mish"),
            (lambda: f"{F}.hardswish({e})", "hardswish"), (lambda: f"{F}.logsigmoid({e})", "logsigmoid"),
            (lambda: f"{F}.normalize({e}, dim={r.randrange(nd)})", "normalize"),
            (lambda: f"{F}.layer_norm({e}, {lit(shape[-1:])})", "layer_norm"),
            (lambda: f"{F}.layer_norm({e}, {lit(shape[-1:])}, {self.param(shape[-1:], dt)}, "
                     f"{self.param(shape[-1:], dt)})", "layer_norm"),
            (lambda: f"{F}.linear({e}, {self.param((features, shape[-1]), dt)}, "
                     f"{self.param((features,), dt) if r.random() < 0.6 else 'None'})", "linear"),
            (lambda: f"{F}.pad({e}, {lit((r.randint(0, 2), r.randint(0, 2)))}, value={self.scalar('float')})", "pad"),
            (lambda: f"{F}.dropout({e}, 0.3, training=False)", "dropout_eval"),
        ]
        special = []  # ops over channels and windows: chosen more often where the shape allows

        def batch_norm():
            rm, rv = self.fresh(), self.fresh()
            wb = f", {self.param((c,), dt)}, {self.param((c,), dt)}" if r.random() < 0.5 else ""
            return (f"{rm} = {self.rand_expr((c,), dt)}; {rv} = {self.rand_expr((c,), dt, positive=True)}; "
                    f"{self.fresh()} = {F}.batch_norm({e}, {rm}, {rv}{wb}, training={r.random() < 0.7}, "
                    f"momentum={r.choice([0.1, 0.5])})")

        if nd >= 2 and shape[0] * math.prod(shape[2:]) > 1:
            groups = [g for g in (1, 2, 3) if c % g == 0]
            special += [(batch_norm, "batch_norm"),
                        (lambda: f"{F}.batch_norm({e}, None, None, training=True)", "batch_norm"),
                        (lambda: f"{F}.group_norm({e}, {r.choice(groups)})", "group_norm")]
        if nd in (3, 4) and math.prod(shape[2:]) > 1:
            special.append((lambda: f"{F}.instance_norm({e})", "instance_norm"))
        if nd == 3 and shape[2] >= 2:
            k = r.randint(1, min(3, shape[2]))
            special += [
                (lambda: f"{F}.conv1d({e}, {self.param((r.randint(1, 4), c, k), dt)}, "
                         f"stride={r.randint(1, 2)}, padding={r.randint(0, 1)})", "conv1d"),
                (lambda: f"{F}.max_pool1d({e}, {k})", "max_pool1d"), (lambda: f"{F}.avg_pool1d({e}, {k})", "avg_pool1d"),
                (lambda: f"{F}.interpolate({e}, scale_factor=2, mode={r.choice(['nearest', 'linear'])!r})",
                 "interpolate"),
                (lambda: f"{F}.scaled_dot_product_attention({e}, {e} * 0.5, {e}, is_causal={r.random() < 0.5})",
                 "sdpa")]
        if nd == 4 and min(shape[2:]) >= 2:
            special += [
                (lambda: f"{F}.conv2d({e}, {self.param((r.randint(1, 3), c, 2, 2), dt)}, padding={r.randint(0, 1)})",
                 "conv2d"),
                (lambda: f"{F}.max_pool2d({e}, 2)", "max_pool2d"),
                (lambda: f"{F}.adaptive_avg_pool2d({e}, 1)", "adaptive_avg_pool2d"),
                (lambda: f"{F}.interpolate({e}, scale_factor=2, mode='bilinear')", "interpolate")]
        if nd == 2 and min(shape) >= 1:
            target = f"torch.tensor({lit([r.randrange(c) for _ in range(shape[0])])}, device=dev)"
            special += [
                (lambda: f"{F}.cross_entropy({e}, {target})", "cross_entropy"),
                (lambda: f"{F}.cross_entropy({e}, {target}, label_smoothing=0.1, reduction='sum')", "cross_entropy"),
                (lambda: f"{F}.mse_loss({e}, {e}.flip(0))", "mse_loss")]
        make, op = r.choice(special if special and r.random() < 0.65 else options)
        src = make()
        self.emit(src if "; " in src else f"{self.fresh()} = {src}", "nn." + op)

    # -- autograd

    def leaves(self):
        return self.names(lambda x: x.is_leaf and x.requires_grad)

    def loss_expr(self, t):
        if self.val(t).is_complex():
            return f"{t}.abs().sum()"
        return self.rng.choice([f"{t}.sum()", f"({t} * {t}).mean()", f"{t}.exp().sum()", f"{t}.abs().sum()"])

    def g_backward(self):
        r = self.rng
        t = self.pick(lambda x: x.requires_grad)
        if t is None or not self.leaves():
            self.g_input(dtype=torch.float32, grad=True)
            return
        vt = self.val(t)
        options = [f"{self.loss_expr(t)}.backward()", f"{self.loss_expr(t)}.backward(retain_graph=True)",
                   f"{t}.backward(torch.ones_like({t}))"]
        if vt.numel() == 1 or r.random() < 0.1:
            options.append(f"{t}.backward()")
        self.emit(r.choice(options), "autograd.backward")

    def g_autograd_grad(self):
        r = self.rng
        t = self.pick(lambda x: x.requires_grad)
        leaves = self.leaves()
        if t is None or not leaves:
            self.g_input(dtype=torch.float32, grad=True)
            return
        wrt = r.sample(leaves, min(len(leaves), r.randint(1, 2)))
        outs = [self.fresh() for _ in wrt]
        retain = ", retain_graph=True" if r.random() < 0.5 else ""
        create = ", create_graph=True" if r.random() < 0.15 else ""
        call = f"torch.autograd.grad({self.loss_expr(t)}, [{', '.join(wrt)}], allow_unused=True{retain}{create})"
        lhs = f"{outs[0]}, {outs[1]}" if len(outs) == 2 else f"{outs[0]},"
        self.emit(f"{lhs} = {call}", "autograd.grad")

    def g_grad_read(self):
        w = self.pick(lambda x: x.is_leaf and x.requires_grad)
        if w is None:
            return
        # A copy: eager accumulates into .grad in place or not depending on
        # who else holds it, and a reference held here would decide that.
        src = f"{w}.grad" if self.val(w).grad is None else f"{w}.grad.clone()"
        self.emit(f"{self.fresh()} = {src}", "autograd.read_grad")

    def g_grad_update(self):
        r = self.rng
        w = self.pick(lambda x: x.is_leaf and x.requires_grad and x.grad is not None)
        if w is None:
            return
        src = r.choice([f"with torch.no_grad(): {w}.sub_(0.1 * {w}.grad)", f"{w}.grad = None",
                        f"{w}.grad.zero_()", f"with torch.no_grad(): {w}.mul_(0.5)"])
        self.emit(src, "autograd.update")

    # -- syncs

    def g_sync(self):
        r = self.rng
        a = self.pick(large=True)
        if a is None:
            return
        va = self.val(a)
        options = [("torch_mgpu.synchronize()", "synchronize")] * 3
        options += [(f"{self.fresh('h')} = {a}.to('cpu', copy=True)", "to_cpu")] * 2
        options += [(f"{self.fresh('s')} = {a}.sum().item()", "item"),
                    (f"{self.fresh('s')} = bool({a}.any())", "bool")]
        if va.numel() == 1:
            options.append((f"{self.fresh('s')} = {a}.item()", "item"))
        if va.numel() <= 12:
            options.append((f"{self.fresh('s')} = {a}.tolist()", "tolist"))
        if va.numel() and not va.is_complex():
            options.append((f"{self.fresh('s')} = int({a}.argmax())", "int"))
        hosts = self.names(prefix="h")
        if hosts:
            options.append((f"{self.fresh()} = {r.choice(hosts)}.to(dev, copy=True)", "upload"))
        if r.random() < 0.2:
            options.append((f"{self.fresh('s')} = {a}.stride()", "stride"))
        src, op = r.choice(options)
        self.emit(src, "sync." + op)

    def g_default_dtype(self):
        dt = torch.float32 if torch.get_default_dtype() == torch.float64 else torch.float64
        self.emit(f"torch.set_default_dtype({dt})", "default_dtype")

    # -- calls eager refuses

    def g_error(self):
        r = self.rng
        a = self.pick(lambda x: x.numel() > 0)
        if a is None:
            return
        va = self.val(a)
        shape, nd, kind = tuple(va.shape), va.dim(), kind_of(va)
        v = self.fresh()
        options = [
            (f"{v} = torch.add({a}, 1, out=torch.zeros({lit(shape)}, dtype=torch.bool, device=dev))", "out_dtype"),
            (f"{v} = {a}.view(-1, {va.numel() + 1})", "view"),
            (f"{v} = {a}.sum({nd + 1})", "dim"),
            (f"{v} = {a}.expand({lit((2,) * (nd + 1))}) + torch.ones(3, device=dev)", "shape"),
        ]
        if va.is_floating_point():
            options.append((f"{v} = torch.mul({a}, 1.5, out=torch.zeros({lit(shape)}, dtype=torch.int64, "
                            f"device=dev))", "out_dtype"))
        big = [i for i, s in enumerate(shape) if s >= 2]
        if big:
            i = r.choice(big)
            bad = tuple(s + 1 if j == i else 1 for j, s in enumerate(shape))
            options += [(f"{v} = {a} + torch.ones({lit(bad)}, device=dev)", "shape"),
                        (f"{a}.add_(torch.ones({lit((2,) + shape)}, dtype={va.dtype}, device=dev))", "shape"),
                        (f"{v} = torch.cat([{a}, torch.zeros({lit(bad)}, dtype={va.dtype}, device=dev)])", "cat")]
        if nd >= 1:
            n = shape[0]
            options += [(f"{v} = {a}[::-1]", "negative_step"),
                        (f"{v} = {a}[torch.tensor([{n + r.randint(0, 2)}], device=dev)]", "index_bounds"),
                        (f"{v} = {a}.index_select(0, torch.tensor([0, {n}], device=dev))", "index_bounds"),
                        (f"{v} = torch.gather({a}, 0, torch.full({lit((1,) + shape[1:])}, {n}, device=dev))",
                         "index_bounds"),
                        (f"{a}[torch.tensor([{n}], device=dev)] = 0", "index_bounds")]
        if nd == 2:
            options.append((f"{v} = {a} @ torch.ones({shape[1] + 1}, 2, dtype={va.dtype}, device=dev)", "matmul"))
        if va.numel() > 1:
            options.append((f"{self.fresh('s')} = {a}.item()", "item"))
        if kind == "int":
            options += [(f"{a}.div_(2)", "inplace_dtype"), (f"{v} = {a}.mean()", "mean_int"),
                        (f"{v} = {a} // torch.zeros_like({a})", "zero_division"),
                        (f"{v} = {a} % torch.zeros_like({a})", "zero_division")]
        if kind == "bool":
            options.append((f"{v} = {a} - {a}", "bool_sub"))
        if va.is_leaf and va.requires_grad:
            options.append((f"{a}.add_(1)", "leaf_inplace"))
        src, op = r.choice(options)
        self.emit(src, "error." + op, expect_error=True)


def generate(seed, max_stmts=24):
    """The program of `seed` (deterministic)."""
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        return Gen(seed, max_stmts).build()
    finally:
        torch.set_default_dtype(saved)


# ---------------------------------------------------------------------------
# Running and comparing

@dataclasses.dataclass
class Raised:
    cls: type
    msg: str
    # The out= tensors of the call ({name: metadata}) before and after it
    # raised: whether it left them as they were.
    outs_before: dict = None
    outs_after: dict = None
    # Other names bound to a tensor the call writes (an out= tensor, the
    # receiver of an in-place op, the target of `x[i] = v`; `y = x.to(x.device)`
    # is x) or, on the host, to its storage: a side effect on one is one on them.
    aliases: frozenset = frozenset()

    def __str__(self):
        first = self.msg.strip().splitlines()[0] if self.msg.strip() else ""
        return f"{self.cls.__name__}: {first[:160]}"


@dataclasses.dataclass
class Trace:
    steps: list      # per statement: Raised, or {name: metadata} of the names it defined
    values: dict     # name -> value read at the end (host tensors, numbers, ...) or Raised
    sync: object     # None, or Raised from the final synchronize()
    # Statements that wrote a tensor and ran: the other names bound to the
    # tensors they wrote, or (on the host) to those tensors' storage, such as
    # views taken before the write.
    aliases: dict = dataclasses.field(default_factory=dict)
    # Statements that defined one of autograd's zero tensors (on the host).
    zero_tensors: frozenset = frozenset()


def meta(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), x.requires_grad)
    if isinstance(x, torch.Size):
        return ("Size", tuple(x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(meta(e) for e in x))
    return (type(x).__name__,)


def read(x):
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if torch._is_zerotensor(x):
            x = x.clone()  # autograd's zero tensors have no bytes to show
        return x.resolve_conj().resolve_neg()
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return [read(e) for e in x]
    return x


def _host_storage(t):
    """Where a strided host tensor's bytes start; None for one without bytes
    (empty, or autograd's zero tensors)."""
    if t.layout != torch.strided or torch._is_zerotensor(t) or t.untyped_storage().nbytes() == 0:
        return None
    return t.untyped_storage().data_ptr()


def _aliases(ns, outs, dev):
    targets = [ns[o] for o in outs if isinstance(ns.get(o), torch.Tensor)]
    found = set()
    for name, v in ns.items():
        if name in outs or not isinstance(v, torch.Tensor):
            continue
        for t in targets:
            if v is t or (dev == "cpu" and _host_storage(v) is not None and _host_storage(v) == _host_storage(t)):
                found.add(name)
    return frozenset(found)


def run(prog, dev):
    """Runs `prog` with `dev` ("cpu" or "mgpu"); every statement runs, one
    that raised defines nothing."""
    ns = namespace(dev)
    ns["__read"] = read
    steps, values, sync, written, zeros = [], {}, None, {}, set()
    torch.set_default_dtype(torch.float32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, (code, defs, st) in enumerate(zip(prog.codes, prog.defs, prog.stmts)):
                outs = st.outs & ns.keys()
                before = {name: meta(ns[name]) for name in outs}
                try:
                    exec(code, ns)
                except Exception as e:
                    steps.append(Raised(type(e), str(e), before, {name: meta(ns[name]) for name in outs},
                                        _aliases(ns, (st.outs | st.writes) & ns.keys(), dev)))
                    continue
                steps.append({name: meta(ns[name]) for name in defs if name in ns})
                if st.writes:
                    written[i] = _aliases(ns, (st.outs | st.writes) & ns.keys(), dev)
                if any(isinstance(ns.get(n), torch.Tensor) and torch._is_zerotensor(ns[n]) for n in defs):
                    zeros.add(i)
            for names in prog.defs:
                for name in names:
                    if name in ns:
                        try:
                            exec(prog.reads[name], ns)
                            values[name] = ns.pop("__value")
                        except Exception as e:
                            values[name] = Raised(type(e), str(e))
            try:
                exec(prog.sync, ns)
            except Exception as e:
                sync = Raised(type(e), str(e))
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
    return Trace(steps, values, sync, written, frozenset(zeros))


@dataclasses.dataclass
class Mismatch:
    index: int       # the statement (len(program) for the final sync)
    name: str        # the value concerned, if any
    kind: str        # "deferred error" (eager raised, mgpu did not), "spurious error" (the
                     # reverse), "exception class", "metadata", "value", "read", "sync"
    tag: str         # the statement's tag
    detail: str
    via: int = None  # a call that raised on both sides before this, and changed what this reads
    via_tag: str = None
    # A read that raised an error mgpu deferred: the statement whose op
    # raised it (mgpu's message names where the op was called).
    origin: int = None

    @property
    def signature(self):
        if self.via is not None:
            return ("side effect of a failed call", self.via_tag)
        return (self.kind, self.tag)

    def __str__(self):
        where = f"{self.name} (statement {self.index})" if self.name else f"statement {self.index}"
        after = "" if self.via is None else f" after the failed call at statement {self.via} ({self.via_tag})"
        return f"{self.kind} mismatch at {where}, {self.tag}{after}: {self.detail}"


class Mismatches(list):
    """compare()'s mismatches; `failed_calls`: the statements that raised the
    same exception class on both sides (eager may have written part of its
    operands before raising, such as an out= tensor resized); `documented`:
    the statements whose effects on what they write differ from eager's as
    README's "Differences from eager" says (a call that raised and left its
    out= tensors as they were; an out= call whose out= tensor shares memory
    with an input)."""
    failed_calls = ()
    documented = frozenset()
    aliases = {}  # failed call -> other names bound to the tensors it writes
    written = {}  # statement -> other names bound to what it wrote (views taken before included)


def short(t):
    if isinstance(t, torch.Tensor) and t.numel() <= 12:
        return str(t.tolist())
    if isinstance(t, torch.Tensor):
        return f"tensor{tuple(t.shape)}"
    return repr(t)[:120]


# Tolerances that the configuration being compared loosens (configured()).
TOLERANCE = {"rtol": 0.0, "atol": 0.0}
# torch.testing.assert_close's defaults.
_DEFAULT_TOLERANCE = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
                      torch.float64: (1e-7, 1e-7), torch.complex32: (1e-3, 1e-5), torch.complex64: (1.3e-6, 1e-5),
                      torch.complex128: (1e-7, 1e-7)}


def differ(a, b):
    """Why host value `b` (mgpu) differs from `a` (cpu), or None."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"cpu {a.dtype}{tuple(a.shape)}, mgpu {b.dtype}{tuple(b.shape)}"
        if a.is_floating_point() or a.is_complex():
            rtol, atol = _DEFAULT_TOLERANCE.get(a.dtype, (1e-7, 1e-7))
            try:
                torch.testing.assert_close(b, a, equal_nan=True, rtol=max(rtol, TOLERANCE["rtol"]),
                                           atol=max(atol, TOLERANCE["atol"]))
                return None
            except AssertionError as e:
                lines = [ln.strip() for ln in str(e).splitlines() if "mismatched" in ln.lower()]
                why = lines[0] if lines else "values differ"
                return f"{why}; cpu {short(a)}, mgpu {short(b)}"
        if torch.equal(a, b):
            return None
        return f"{int((a != b).sum())} of {a.numel()} differ; cpu {short(a)}, mgpu {short(b)}"
    if type(a) is not type(b):
        return f"cpu {type(a).__name__} {short(a)}, mgpu {type(b).__name__} {short(b)}"
    if isinstance(a, list):
        if len(a) != len(b):
            return f"cpu {len(a)} items, mgpu {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = differ(x, y)
            if why:
                return f"[{i}]: {why}"
        return None
    if isinstance(a, (float, complex)):
        rtol, atol = max(1e-5, TOLERANCE["rtol"]), max(1e-5, TOLERANCE["atol"])
        if (a != a and b != b) or a == b or abs(a - b) <= atol + rtol * abs(a):
            return None
        return f"cpu {a!r}, mgpu {b!r}"
    return None if a == b else f"cpu {a!r}, mgpu {b!r}"


# The float whose bytes a dtype view reads as integers (view_expr's reinterprets).
_FLOAT_OF_SIZE = {torch.int32: torch.float32, torch.int64: torch.float64}
_BIT_VIEW = re.compile(r"\.view\(torch\.int(32|64)\)")


def loosened():
    """Whether the configuration loosens eager's tolerance (tier 1)."""
    return TOLERANCE["rtol"] != 0 or TOLERANCE["atol"] != 0


def close_as_viewed_floats(prog, name, a, b):
    """Whether the integers `a` (cpu) and `b` (mgpu) of `name`, which a
    dtype view of a float reaches, are that float's bits within the
    tolerance the configuration loosens: compiled code rounds a float
    otherwise (a layer norm, a variance), and its bits read as an integer
    differ by units (seeds 3740304, 3810610, 3810978). Never where the
    tolerance is eager's own, and never for elements that differ as small
    integers (floats below the normal range)."""
    if not loosened():
        return False
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
            or a.shape != b.shape or a.dtype not in _FLOAT_OF_SIZE:
        return False
    # A bit view is a statement of its own or an operand of another one
    # (`torch.ceil(x.view(torch.int32))`, seed 3915424).
    views = {j: st.stores for j, st in enumerate(prog.stmts)
             if st.tag.endswith("view_dtype") or _BIT_VIEW.search(st.src)}
    if name not in tainted(prog, views):
        return False
    fa, fb = a.view(_FLOAT_OF_SIZE[a.dtype]), b.view(_FLOAT_OF_SIZE[a.dtype])
    tiny = torch.finfo(fa.dtype).tiny
    differing = a != b
    if not bool(((fa.abs() >= tiny) & (fb.abs() >= tiny))[differing].all()):
        return False
    # Relative only: the bits of two far apart floats below an absolute
    # tolerance are far apart integers.
    try:
        torch.testing.assert_close(fb, fa, rtol=max(_DEFAULT_TOLERANCE[fa.dtype][0], TOLERANCE["rtol"]), atol=0.0)
    except AssertionError:
        return False
    return True


# Statements whose result jumps where an operand crosses a point (an
# integer, a multiple of the divisor, the other operand): an operand that
# compiled code rounded otherwise, within the loosened tolerance, may fall
# on the other side of it.
_STEP_TAGS = frozenset(["binary//", "binary%", "binary==", "binary<", "binary>=", "binary!=", "binary.fmod",
                        "binary.remainder", "binary.eq", "binary.floor_divide", "unary.floor", "unary.ceil",
                        "unary.round", "unary.trunc", "unary.sign", "unary.frac"])


def inexact_floats(ref, got):
    """The names whose floating values mgpu computed within the tolerance
    the configuration loosens, but not bit for bit (NaNs equal). None where
    the tolerance is eager's own."""
    if not loosened():
        return None
    out = set()
    for name, a in ref.values.items():
        b = got.values.get(name)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point() \
                and a.dtype == b.dtype and a.shape == b.shape and not torch.equal(a.nan_to_num(), b.nan_to_num()) \
                and differ(a, b) is None:
            out.add(name)
    return out


def stepped_over(prog, i, inexact):
    """Whether statement i is a step (_STEP_TAGS) of a float operand that
    mgpu computed within the loosened tolerance but not bit for bit: its
    result may then differ by a whole step (difffuzz seed 3937123: the mean
    of a batch norm's result, about 1e-8 either side of 0, floor-divided)."""
    return inexact is not None and prog.stmts[i].tag in _STEP_TAGS and bool(prog.stmts[i].loads & inexact)


# Periodic statements: an operand of large magnitude that compiled code
# computed within the loosened (relative) tolerance may be off by more than
# the absolute tolerance, and its sine by as much (difffuzz seed 3962683: a
# mean with cancellation, off by 1.3e-6 of itself, divides, and the products
# of the quotients, about 1e4, differ by 0.03 before their sine).
_PERIODIC_TAGS = frozenset(["unary.sin", "unary.cos", "unary.tan"])


def amplified(prog, i, inexact):
    """Whether statement i is periodic (_PERIODIC_TAGS) of a float operand
    that mgpu computed within the loosened tolerance but not bit for bit."""
    return inexact is not None and prog.stmts[i].tag in _PERIODIC_TAGS and bool(prog.stmts[i].loads & inexact)


def half_rsqrt_tainted(prog, ref):
    """The names computed from a half or bfloat16 rsqrt (near_a_half_rsqrt),
    found once per comparison; empty where the tolerance is eager's own."""
    if not loosened():
        return frozenset()
    halves = {j: st.stores for j, st in enumerate(prog.stmts)
              if st.tag == "unary.rsqrt" and any(isinstance(ref.values.get(n), torch.Tensor)
                                                 and ref.values[n].dtype in (torch.float16, torch.bfloat16)
                                                 for n in st.stores)}
    return frozenset(tainted(prog, halves)) if halves else frozenset()


def near_a_half_rsqrt(from_half_rsqrt, name, a, b):
    """Whether `name`, computed from a half or bfloat16 rsqrt (in
    `from_half_rsqrt`, half_rsqrt_tainted()), is within eight units in the
    last place of its dtype under a loosened tolerance: eager's own half
    rsqrt rounds twice (1 / sqrt, each rounded) in its scalar loop and once
    in its vector loop (which elements take which depends on the tensor's
    size, layout and the machine's vector width), where compiled code rounds
    once (difffuzz seed 3936884: a gradient of rsqrt three units apart).
    docs/NUMERICS.md."""
    if name not in from_half_rsqrt:
        return False
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
            or a.shape != b.shape or a.dtype not in (torch.float16, torch.bfloat16):
        return False
    eps = torch.finfo(a.dtype).eps
    try:
        torch.testing.assert_close(b, a, rtol=8 * eps, atol=TOLERANCE["atol"], equal_nan=True)
    except AssertionError:
        return False
    return True


_HALVES = (torch.bfloat16, torch.float16)  # loosest tolerance first


def inexact_half_tainted(prog, ref, inexact):
    """{dtype: the names computed from a float16 or bfloat16 name that mgpu
    computed within the loosened tolerance but not bit for bit}, for
    near_an_inexact_half(); empty where the tolerance is eager's own."""
    if inexact is None:
        return {}
    out = {}
    for dtype in _HALVES:
        sources = {j: st.stores for j, st in enumerate(prog.stmts)
                   if any(n in inexact and ref.values[n].dtype == dtype for n in st.stores)}
        if sources:
            out[dtype] = frozenset(tainted(prog, sources))
    return out


def near_an_inexact_half(taints, name, a, b):
    """Whether `name`, a wider float computed from a float16 or bfloat16
    value that compiled code rounded otherwise (in `taints`,
    inexact_half_tainted()), is within that half dtype's relative tolerance
    under a loosened tolerance: the half's error, up to its own tolerance,
    is carried into the wider result (difffuzz seed 3963133: eager's CPU
    prod of five halves rounds each partial product to half, compiled code
    once; the quotient of a float32 by it is 1e-3 of itself apart).
    docs/NUMERICS.md."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
            or a.shape != b.shape or not a.is_floating_point() or a.dtype in _HALVES:
        return False
    for dtype in _HALVES:
        if name in taints.get(dtype, ()):
            try:
                torch.testing.assert_close(b, a, rtol=_DEFAULT_TOLERANCE[dtype][0],
                                           atol=max(_DEFAULT_TOLERANCE[dtype][1], TOLERANCE["atol"]), equal_nan=True)
            except AssertionError:
                return False
            return True
    return False


def surfaced_at_a_sync(error, got, i):
    """Whether eager's `error` at statement i, which mgpu did not raise at
    the call, was raised by mgpu at a later sync point, with eager's class
    and naming the op that failed: errors that depend on data (an index out
    of range, an integer division by zero) are raised by the next sync."""
    later = [s for s in got.steps[i + 1:] if isinstance(s, Raised)]
    later += [v for v in got.values.values() if isinstance(v, Raised)]
    later += [got.sync] if got.sync is not None else []
    return any(r.cls is error.cls and "mgpu: raised by aten::" in r.msg for r in later)


def compare(prog, ref, got):
    """Mismatches of trace `got` (mgpu) against `ref` (cpu): those at the
    statements in program order, then those of the values read at the end,
    then the final sync."""
    at_stmt, at_end, failed = [], [], []
    # Documented: an out= tensor that is also an input is read before it is
    # written; a 0-dim tensor value assigned through indexing is copied; one
    # of autograd's zero tensors is plain zeros (eager's divides to inf where
    # zeros give nan, and refuses writes).
    documented = [i for i, st in enumerate(prog.stmts) if st.tag.endswith((ALIASED, ZERO_DIM))]
    documented += sorted(ref.zero_tensors - set(documented))
    def_index = {name: i for i, names in enumerate(prog.defs) for name in names}
    for i, (a, b) in enumerate(zip(ref.steps, got.steps)):
        tag = prog.stmts[i].tag
        ra, rb = isinstance(a, Raised), isinstance(b, Raised)
        if ra or rb:
            if ra and rb and a.cls is b.cls:
                failed.append(i)
                if prog.stmts[i].outs and b.outs_after == b.outs_before:
                    # Documented: a call that raises leaves its out= tensors
                    # as they were (eager may resize or write them first).
                    documented.append(i)
                elif tag == "nn.batch_norm":
                    # Documented: and batch norm's running statistics (eager
                    # updates them before it refuses a bias's dtype).
                    documented.append(i)
            elif ra and not rb and "ZeroTensors are immutable" in a.msg:
                # Documented: autograd's zero tensors are plain zeros on mgpu,
                # and a write into one is made (eager refuses it).
                failed.append(i)
                documented.append(i)
            elif rb and not ra and tag.endswith(ZERO_DIM) and "refer to a single memory location" in b.msg:
                # Documented: the copy of a 0-dim value that overlaps what it
                # writes is refused, as on CUDA (eager's fill reads it first).
                failed.append(i)
            elif ra and not rb and tag.endswith(ZERO_DIM) and "refers to a single memory location" in a.msg:
                # Documented, the other way round: eager's fill refuses a
                # target whose elements share memory (an expanded 0-dim
                # tensor); the copy of a value that is those very bytes
                # (the target's own element, expanded alike) copies nothing,
                # as on CUDA (copy_ returns at once for the same data).
                failed.append(i)
            elif ra and not rb and surfaced_at_a_sync(a, got, i):
                # Deferred as documented: what follows from it is the
                # program going on past an error eager stopped at.
                failed.append(i)
                at_stmt.append(Mismatch(i, None, "deferred to a sync", tag, f"cpu: {a}"))
            else:
                kind = "deferred error" if not rb else "spurious error" if not ra else "exception class"
                at_stmt.append(Mismatch(i, None, kind, tag, f"cpu: {a if ra else 'no exception'}; "
                                                            f"mgpu: {b if rb else 'no exception'}"))
            continue
        for name, m in a.items():
            if b.get(name) != m:
                at_stmt.append(Mismatch(i, name, "metadata", tag, f"cpu {m}, mgpu {b.get(name)}"))
    inexact = inexact_floats(ref, got)
    from_half_rsqrt = half_rsqrt_tainted(prog, ref)
    from_inexact_half = inexact_half_tainted(prog, ref, inexact)
    for name, a in ref.values.items():
        if name not in got.values:
            continue
        b = got.values[name]
        i = def_index[name]
        if isinstance(a, Raised) or isinstance(b, Raised):
            if not (isinstance(a, Raised) and isinstance(b, Raised) and a.cls is b.cls):
                m = Mismatch(i, name, "read", prog.stmts[i].tag,
                             f"reading it: cpu {a if isinstance(a, Raised) else 'ok'}; "
                             f"mgpu {b if isinstance(b, Raised) else 'ok'}")
                if isinstance(b, Raised) and not isinstance(a, Raised):
                    called = re.search(r"called at <difffuzz seed=\d+ stmt=(\d+)>", b.msg)
                    if called and int(called.group(1)) < len(prog.stmts):
                        m.origin = int(called.group(1))
                at_end.append(m)
            continue
        why = differ(a, b)
        if why and not close_as_viewed_floats(prog, name, a, b) and not near_a_half_rsqrt(from_half_rsqrt, name, a, b) \
                and not near_an_inexact_half(from_inexact_half, name, a, b):
            if stepped_over(prog, i, inexact) or amplified(prog, i, inexact):
                documented.append(i)  # what reads it follows from it (primary())
            at_end.append(Mismatch(i, name, "value", prog.stmts[i].tag, why))
    at_end.sort(key=lambda m: m.index)
    if got.sync is not None and ref.sync is None:
        at_end.append(Mismatch(len(prog), None, "sync", "sync", f"final synchronize() raised {got.sync}"))
    out = Mismatches(at_stmt + at_end)
    out.failed_calls = tuple(failed)
    out.documented = frozenset(documented)
    out.aliases = {i: frozenset().union(*(s.aliases for s in (ref.steps[i], got.steps[i]) if isinstance(s, Raised)))
                   for i in failed}
    for i in documented:
        out.aliases[i] = out.aliases.get(i, frozenset()) | ref.aliases.get(i, frozenset()) | got.aliases.get(i, frozenset())
    out.written = {i: ref.aliases.get(i, frozenset()) | got.aliases.get(i, frozenset())
                   for i in set(ref.aliases) | set(got.aliases)}
    return out


ERROR_KINDS = ("deferred error", "spurious error", "exception class")
ALIASED = ".aliased"   # the tag's end for an out= call whose out= tensor shares memory with an input
ZERO_DIM = ".zero_dim_value"  # the tag's end for `x[i] = t` that meets the documented copy_ of a 0-dim t


def tainted(prog, sources, upto=None, written=None):
    """The names that depend on `sources` ({statement index: names it
    touched}) before statement `upto`: those names, and all that a later
    statement binds or mutates after reading one of them, with the other
    names of what it mutates (`written`: statement -> names, such as a view
    taken before the write; without it, forward only)."""
    written = written or {}
    out = set()
    for i, st in enumerate(prog.stmts[:upto]):
        if i in sources:
            out |= sources[i]
        elif st.loads & out:
            out |= st.stores | st.writes | written.get(i, frozenset())
    return out


def primary(prog, mismatches):
    """The mismatches that are not plainly consequences of earlier ones.
    Not counted: a mismatch at a statement that reads a value that already
    mismatched (or was computed from one); after an error eager raises and
    mgpu does not, further exception mismatches (the error surfacing at a
    later sync); a missing name (NameError) on one side; and the values read
    at the end, once an exception mismatch happened. A mismatch in what a
    call that raised on both sides had touched is put down to that call
    (`via`): its side effects before raising differ."""
    documented = getattr(mismatches, "documented", frozenset())
    failed = sorted(set(getattr(mismatches, "failed_calls", ())) | documented)
    aliases = getattr(mismatches, "aliases", {})
    written = getattr(mismatches, "written", {})

    def touched(j):
        # An out= tensor that shares memory with an input may be any of
        # the names the call mentions; names bound to an out= tensor are it.
        # What an out= call returns is its out= tensor.
        st = prog.stmts[j]
        names = st.writes | st.loads if st.tag.endswith(ALIASED) else st.writes
        return names | st.stores | aliases.get(j, frozenset())

    def blame(names, upto):
        # The failed calls whose writes reach `names`; of those, one whose
        # difference is documented explains it, else the first.
        found = [j for j in failed
                 if j < upto and (prog.stmts[j].writes or j in documented)
                 and names & tainted(prog, {j: touched(j)}, upto, written)]
        return next((j for j in found if j in documented), found[0] if found else None)

    out, sources = [], {}
    deferred = errors = False
    for m in mismatches:
        if m.kind == "deferred to a sync":
            # Not a mismatch: an error that depends on data, raised by the
            # next sync and naming its op. What mgpu ran past it differs.
            # What mgpu recorded after it on the tensors it writes (through
            # views taken before it too) read its failed output and did not run.
            deferred = errors = True
            sources[m.index] = (sources.get(m.index, set()) | prog.stmts[m.index].stores
                                | prog.stmts[m.index].writes | aliases.get(m.index, frozenset()))
            continue
        if m.kind in ERROR_KINDS or m.kind == "metadata":
            i = m.index
            error = m.kind in ERROR_KINDS
            secondary = (bool(prog.uses[i] & tainted(prog, sources, i, written)) or "NameError" in m.detail
                         or (error and deferred))
            via = None if secondary else blame(prog.uses[i], i)
            if not secondary and via not in documented:
                # An error eager raises that mgpu skips does not depend on
                # what came before, unless a documented difference explains
                # it; anything else may.
                m.via = via if m.kind != "deferred error" else None
                out.append(m)
            deferred |= m.kind == "deferred error"
            errors |= error
            # What it defines, and the operands it may have written (out=, in place).
            sources[i] = sources.get(i, set()) | prog.stmts[i].stores | prog.stmts[i].writes
        elif errors:
            continue
        elif m.kind == "sync":
            out.append(m)
        elif m.name not in tainted(prog, sources, written=written):
            m.via = blame({m.name}, len(prog))
            if m.origin is not None and m.via not in documented:
                # An error deferred from the op at `origin`, raised by the
                # read's sync: what that op read may be a documented
                # difference (a failed out= call that eager resized first).
                origin_via = blame(prog.uses[m.origin], m.origin)
                if origin_via in documented:
                    m.via = origin_via
            if m.via not in documented:
                out.append(m)
            sources[m.index] = sources.get(m.index, set()) | {m.name}
    for m in out:
        if m.via is not None:
            m.via_tag = prog.stmts[m.via].tag
    return out


def run_one_thread(prog):
    """The CPU reference with one intra-op thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(prog, "cpu")
    finally:
        torch.set_num_threads(saved)


def against_eager(prog, ref, got, one_thread=None):
    """compare() against eager CPU, and where that finds mismatches, against
    eager CPU with one thread: a lane runs a kernel with fewer threads than
    eager does, and a reduction split by thread (a matrix-vector product's)
    adds in another order, so a float32 value may differ from eager's in its
    last bits, which later ops can amplify (`x ** y`: seed 993905). What
    matches either reference is no mismatch. `one_thread`: a callable giving
    the one-thread reference (made on demand)."""
    ms = compare(prog, ref, got)
    if not ms or torch.get_num_threads() == 1:
        return ms
    return compare(prog, one_thread() if one_thread else run_one_thread(prog), got)


def check(programs, configs=CONFIGS, timeout_s=None, on_config=None):
    """Runs each program on CPU, then on mgpu under each configuration.
    Returns {seed: [(config, [Mismatch, ...]), ...]} for the programs that
    mismatch, and the number of mgpu runs."""
    refs = [run(p, "cpu") for p in programs]
    one_thread = {}

    def one_thread_ref(prog):
        if prog.seed not in one_thread:
            one_thread[prog.seed] = run_one_thread(prog)
        return one_thread[prog.seed]
    found, runs = {}, 0
    for cfg in configs:
        if on_config:
            on_config(cfg)
        with configured(cfg):
            for prog, ref in zip(programs, refs):
                if timeout_s:
                    faulthandler.dump_traceback_later(timeout_s, exit=True)
                try:
                    got = run_mgpu(prog, cfg)
                finally:
                    if timeout_s:
                        faulthandler.cancel_dump_traceback_later()
                runs += 1
                ms = against_eager(prog, ref, got, lambda prog=prog: one_thread_ref(prog))
                if ms:
                    found.setdefault(prog.seed, []).append((cfg, ms))
    return found, runs


# ---------------------------------------------------------------------------
# Shrinking and reproducers

def shrink(prog, fails, deadline=None):
    """Delta debugging: the smallest program found (1-minimal if time
    allows) for which `fails(program)` holds. Dropping a statement drops the
    statements that need a name it defined."""
    cur = prog
    n = 2
    while len(cur) >= 2:
        size = len(cur)
        chunk = math.ceil(size / n)
        for start in range(0, size, chunk):
            if deadline is not None and time.monotonic() > deadline:
                return cur
            cand = cur.keep(set(range(size)) - set(range(start, start + chunk)))
            if len(cand) < size and fails(cand):
                cur, n = cand, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(2 * n, size)
    return cur


def mismatches_under(prog, cfg):
    with configured(cfg):
        return against_eager(prog, run(prog, "cpu"), run_mgpu(prog, cfg))


def minimize(prog, cfg, signature, budget_s=60.0):
    """`prog` shrunk while it still shows a mismatch of `signature` (kind,
    statement tag) under `cfg`."""
    deadline = time.monotonic() + budget_s

    def fails(p):
        return any(m.signature == signature for m in primary(p, against_eager(p, run(p, "cpu"), run_mgpu(p, cfg))))

    with configured(cfg):
        return shrink(prog, fails, deadline)


def reproducer(prog, cfg, signature, fails_under=()):
    """A runnable snippet that shows the first `signature` mismatch of `prog`
    under `cfg` (None if it shows none)."""
    ms = [m for m in primary(prog, mismatches_under(prog, cfg)) if m.signature == signature]
    return render(prog, ms[0], cfg, fails_under) if ms else None


def render(prog, m, cfg, fails_under=()):
    """Mismatch `m` of `prog` under `cfg` as a standalone script: `program(dev)`
    holds the statements (those that raise on CPU inside try, when `m` is
    not about them), then the script runs it on both devices and prints (for
    exceptions) or asserts (for values) what differs."""
    ref = run(prog, "cpu")
    lines = [f"# difffuzz seed {prog.seed}, {cfg.name}: {m}"]
    if fails_under:
        lines.append(f"# mismatches under: {', '.join(c.name for c in fails_under)}")
    lines += ["import torch", "import torch_mgpu", ""] + cfg.setup_lines() + ["", "", "def program(dev):"]
    if any("set_default_dtype" in st.src for st in prog.stmts):
        lines.append("    torch.set_default_dtype(torch.float32)")
    error = m.kind in ERROR_KINDS
    last = m.index if error else len(prog) - 1
    for i, st in enumerate(prog.stmts[:last + 1]):
        step = ref.steps[i]
        if isinstance(step, Raised) and i != m.index:
            lines += ["    try:", f"        {st.src}", "    except Exception:",
                      f"        pass  # cpu: {step.cls.__name__}"]
        elif isinstance(step, Raised):
            lines.append(f"    {st.src}  # cpu: {step.cls.__name__}")
        else:
            lines.append(f"    {st.src}")
    lines.append("")
    warm_up = cfg.warm_up_lines()
    if error:
        lines += [""] + warm_up + ['for dev in ("cpu", "mgpu"):', "    try:", "        program(dev)",
                  '        print(dev, "-> no exception")', "    except Exception as e:",
                  '        print(dev, "->", type(e).__name__, e)']
    elif m.kind == "sync":
        lines += ["", 'program("cpu")'] + warm_up + ['program("mgpu")', "torch_mgpu.synchronize()  # raises on mgpu"]
    else:
        lines[-1:] = [f"    return {m.name}", "", "", 'expected = program("cpu")'] + warm_up + ['actual = program("mgpu")']
        expected = ref.values.get(m.name)
        if m.kind == "metadata" and isinstance(expected, torch.Tensor):
            lines += ['print("cpu: ", expected.dtype, tuple(expected.shape), expected.requires_grad)',
                      'print("mgpu:", actual.dtype, tuple(actual.shape), actual.requires_grad)',
                      "assert (actual.dtype, actual.shape, actual.requires_grad) == "
                      "(expected.dtype, expected.shape, expected.requires_grad)"]
        elif isinstance(expected, torch.Tensor):
            lines += ['print("cpu: ", expected)', 'print("mgpu:", actual.cpu())',
                      f"torch.testing.assert_close(actual.cpu(), expected{tolerance_args(expected, cfg)}, equal_nan=True)"]
        elif expected is None:
            lines += ['print("cpu: ", expected)', 'print("mgpu:", actual)', "assert actual is None"]
        else:
            lines += ['print("cpu: ", expected)', 'print("mgpu:", actual)',
                      "assert type(actual) is type(expected)",
                      f"torch.testing.assert_close(actual, expected{tolerance_args(expected, cfg)}, equal_nan=True)"]
    return "\n".join(lines) + "\n"


def tolerance_args(expected, cfg):
    """assert_close's tolerance arguments for a reproducer's check of
    `expected` under `cfg`, as differ() compares: ", rtol=.., atol=.." where
    the configuration's tolerance is looser than assert_close's default for
    the value (tier 1), else nothing."""
    if not (cfg.rtol or cfg.atol):
        return ""
    def loosest(v):
        if isinstance(v, torch.Tensor):
            return _DEFAULT_TOLERANCE.get(v.dtype, (1e-7, 1e-7)) if v.is_floating_point() or v.is_complex() else None
        if isinstance(v, (float, complex)):
            return 1e-5, 1e-5
        if isinstance(v, (list, tuple)):  # differ() compares item by item
            tols = [t for t in map(loosest, v) if t is not None]
            return (max(t[0] for t in tols), max(t[1] for t in tols)) if tols else None
        return None

    tol = loosest(expected)
    if tol is None:
        return ""
    return f", rtol={max(tol[0], cfg.rtol)!r}, atol={max(tol[1], cfg.atol)!r}"


def render_crash(prog, cfg, what):
    """A standalone script that runs `prog` on mgpu under `cfg` as the
    fuzzer does (every value read at the end), for a program that `what`
    (crashes the process, hangs)."""
    ref = run(prog, "cpu")
    lines = [f"# difffuzz seed {prog.seed}, {cfg.name}: {what}", "import torch", "import torch_mgpu", ""]
    lines += cfg.setup_lines() + ["", 'dev = "mgpu"']
    body = []
    for st, step in zip(prog.stmts, ref.steps):
        if isinstance(step, Raised):
            body += ["try:", f"    {st.src}", "except Exception:", f"    pass  # cpu: {step.cls.__name__}"]
        else:
            body.append(st.src)
    names = [n for names in prog.defs for n in names]
    body += [f"for name in {tuple(names)!r}:", "    value = globals().get(name)",
             "    if isinstance(value, torch.Tensor):", "        value.detach().cpu()",
             "torch_mgpu.synchronize()"]
    if cfg.tier1:  # three times: tier 0 makes the graphs hot, the third round runs them compiled
        lines += ['for round in ("tier 0", "tier 0", "tier 1"):'] + ["    " + b for b in body]
        lines += ['    if round == "tier 0":', "        assert torch_mgpu.wait_for_compiles(600)"]
    else:
        lines += body
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Fuzzing loop and report

CONFIG_INDEX = {c.name: i for i, c in enumerate(ALL_CONFIGS)}


@dataclasses.dataclass(repr=False)
class Group:
    """Programs with a primary mismatch of the same signature."""
    signature: tuple
    first: Mismatch
    seeds: list = dataclasses.field(default_factory=list)
    configs: set = dataclasses.field(default_factory=set)
    where: tuple = None          # (seed, config name) of the first program, the one minimized
    reproducer: str = None
    minimized_len: int = None
    original_len: int = None

    def __repr__(self):
        return f"Group({self.signature}, {len(self.seeds)} programs)"


@dataclasses.dataclass(repr=False)
class Crash:
    """A program run that killed the process or hung (CLI runs only: each
    check runs in a child process there)."""
    seed: int
    config: str                  # name of the configuration, None if unknown
    what: str
    log: str                     # faulthandler's lines about it (or the end of the child's stderr)
    reproducer: str = None
    minimized_len: int = None
    original_len: int = None


@dataclasses.dataclass(repr=False)
class Report:
    programs: int = 0
    runs: int = 0
    seconds: float = 0.0
    seeds: list = dataclasses.field(default_factory=list)           # first and last seed checked
    groups: dict = dataclasses.field(default_factory=dict)
    failing_seeds: dict = dataclasses.field(default_factory=dict)   # seed -> [(config name, mismatch)]
    crashes: list = dataclasses.field(default_factory=list)
    tier1_syncs: dict = dataclasses.field(default_factory=lambda: {"compiled": 0, "all": 0})

    def __repr__(self):
        return (f"Report({self.programs} programs, {self.mismatching_programs} mismatching, "
                f"{len(self.groups)} groups, {len(self.crashes)} crashes)")

    @property
    def mismatching_programs(self):
        return len(self.failing_seeds)

    @property
    def ok(self):
        return not self.groups and not self.crashes

    def add(self, seed, config_name, mismatches):
        """The primary mismatches of one program run."""
        self.failing_seeds.setdefault(seed, []).append((config_name, mismatches[0]))
        for m in mismatches:
            g = self.groups.setdefault(m.signature, Group(m.signature, m))
            if not g.seeds or g.seeds[-1] != seed:
                g.seeds.append(seed)
            if g.where is None:
                g.where = (seed, config_name)
            g.configs.add(config_name)

    def checked(self, seeds, runs, tier1_syncs=None):
        self.programs += len(seeds)
        self.runs += runs
        for k, n in (tier1_syncs or {}).items():
            self.tier1_syncs[k] += n
        self.seeds = [min(self.seeds[:1] + list(seeds)), max(self.seeds[1:] + list(seeds))]

    def by_size(self):
        return sorted(self.groups.values(), key=lambda g: -len(g.seeds))

    def summary(self, reproducers=True):
        span = f"seeds {self.seeds[0]}..{self.seeds[1]}" if self.seeds else "no seeds"
        crashes = f"; {len(self.crashes)} crashes or hangs" if self.crashes else ""
        out = [f"difffuzz: {self.programs} programs ({span}), {self.runs} mgpu runs, {self.seconds:.1f} s; "
               f"{self.mismatching_programs} mismatching programs in {len(self.groups)} groups{crashes}"]
        if self.tier1_syncs["all"]:
            out[0] += (f"; tier 1 ran {self.tier1_syncs['compiled']} of the {self.tier1_syncs['all']} syncs "
                       "of the compiled runs")
        for k, g in enumerate(self.by_size(), 1):
            seeds = ", ".join(map(str, g.seeds[:12])) + (", ..." if len(g.seeds) > 12 else "")
            out.append(f"\n[{k}] {g.signature[0]} mismatch at {g.signature[1]}: {len(g.seeds)} programs "
                       f"(seeds {seeds}); configs: {', '.join(sorted(g.configs))}")
            out.append(f"    first: seed {g.seeds[0]}: {g.first}")
            if reproducers and g.reproducer:
                out.append(f"    minimized from {g.original_len} to {g.minimized_len} statements:")
                out.append("\n".join("    | " + ln for ln in g.reproducer.rstrip().splitlines()))
            elif reproducers:
                out.append("    (not minimized)")
        for c in self.crashes:
            out.append(f"\n[crash] seed {c.seed}, {c.config or 'configuration unknown'}: {c.what}")
            out.append("\n".join("    ! " + ln for ln in c.log.rstrip().splitlines()[-12:]))
            if reproducers and c.reproducer:
                out.append(f"    minimized from {c.original_len} to {c.minimized_len} statements:")
                out.append("\n".join("    | " + ln for ln in c.reproducer.rstrip().splitlines()))
        return "\n".join(out)


def minimize_group(prog, cfg, signature, configs, budget_s):
    """(reproducer, minimized length) for a group's first program."""
    small = minimize(prog, cfg, signature, budget_s)
    configs = tuple(configs) + (() if cfg in configs else (cfg,))
    fails_under = [c for c in configs
                   if any(m.signature == signature for m in primary(small, mismatches_under(small, c)))]
    return reproducer(small, cfg, signature, fails_under), len(small)


def fuzz(seeds, configs=CONFIGS, *, seconds=None, batch=16, max_stmts=24, minimize_groups=True,
         minimize_budget_s=60.0, minimize_total_s=None, timeout_s=None, log=None):
    """Checks the programs of `seeds` (an iterable; with `seconds`, until
    that time is spent) in this process, then minimizes the first program
    of each group of mismatches, the largest groups first."""
    start = time.monotonic()
    report = Report()
    it = iter(seeds)
    last_log = start
    while True:
        chunk = list(itertools.islice(it, batch))
        if not chunk:
            break
        progs = [generate(s, max_stmts) for s in chunk]
        before = dict(TIER1_SYNCS)
        found, runs = check(progs, configs, timeout_s)
        report.checked(chunk, runs, {k: TIER1_SYNCS[k] - before[k] for k in before})
        for prog in progs:
            for cfg, ms in found.get(prog.seed, ()):
                ms = primary(prog, ms)
                if ms:  # only errors deferred to a sync, as documented: no mismatch
                    report.add(prog.seed, cfg.name, ms)
        now = time.monotonic()
        if log and now - last_log > 30:
            log(f"[{now - start:.0f} s] {report!r}")
            last_log = now
        if seconds is not None and now - start >= seconds:
            break
    if minimize_groups:
        deadline = None if minimize_total_s is None else time.monotonic() + minimize_total_s
        for g in report.by_size():
            left = minimize_budget_s if deadline is None else min(minimize_budget_s, deadline - time.monotonic())
            if left <= 0:
                break
            seed, cfg_name = g.where
            prog = generate(seed, max_stmts)
            g.reproducer, g.minimized_len = minimize_group(prog, ALL_CONFIGS[CONFIG_INDEX[cfg_name]], g.signature,
                                                           configs, left)
            g.original_len = len(prog)
    report.seconds = time.monotonic() - start
    return report


# ---------------------------------------------------------------------------
# Command line: the checks run in child processes, so that a program that
# crashes or hangs mgpu is reported (and shrunk) and the run goes on.

EVENT = "@@difffuzz "


def emit(**event):
    print(EVENT + json.dumps(event), flush=True)


def child(args, *extra, timeout=None):
    """Runs this script with `extra` arguments; (returncode or None if it
    timed out, stdout events, stderr)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--max-stmts", str(args.max_stmts),
           "--timeout", str(args.timeout), *map(str, extra)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, [], err
    events = [json.loads(ln[len(EVENT):]) for ln in done.stdout.splitlines() if ln.startswith(EVENT)]
    return done.returncode, events, done.stderr


def run_worker(args, configs):
    """--worker: checks seeds from --seed (--programs of them, less --skip,
    until --deadline), reporting each batch as events."""
    skip = {int(s) for s in args.skip.split(",") if s} if args.skip else set()
    seeds = (s for s in range(args.seed, args.seed + args.programs) if s not in skip)
    while args.deadline is None or time.time() < args.deadline:
        chunk = list(itertools.islice(seeds, 16))
        if not chunk:
            break
        emit(batch=chunk)
        progs = [generate(s, args.max_stmts) for s in chunk]
        before = dict(TIER1_SYNCS)
        found, runs = check(progs, configs, args.timeout, on_config=lambda c: emit(config=c.name))
        # A run whose every difference is accounted for (an error deferred to
        # a sync, and what follows from it) is not a failure.
        failures = [{"seed": p.seed, "config": cfg.name, "mismatches": [dataclasses.asdict(m) for m in kept]}
                    for p in progs for cfg, ms in found.get(p.seed, ()) for kept in [primary(p, ms)] if kept]
        emit(done=chunk, runs=runs, failures=failures, tier1_syncs={k: TIER1_SYNCS[k] - before[k] for k in before})
    return 0


def run_minimize(args):
    """--minimize: shrinks program --seed for signature --kind/--tag under
    --config, reporting the reproducer as an event."""
    prog = generate(args.seed, args.max_stmts)
    cfg = ALL_CONFIGS[args.config]
    text, size = minimize_group(prog, cfg, (args.kind, args.tag), CONFIGS, args.minimize_seconds)
    emit(reproducer=text, minimized_len=size, original_len=len(prog))
    return 0


def run_exec(args):
    """--exec: runs program --seed (only statements --keep, if given) on mgpu
    under --config, as a check does."""
    prog = generate(args.seed, args.max_stmts)
    if args.keep is not None:
        prog = prog.keep({int(i) for i in args.keep.split(",") if i})
    cfg = ALL_CONFIGS[args.config]
    with configured(cfg):
        run_mgpu(prog, cfg)
    return 0


def shrink_crash(args, crash, budget_s):
    """Shrinks a crashing (or hanging) program, each candidate run in a
    child process; fills in crash.reproducer."""
    if crash.config is None:
        return
    cfg_index = CONFIG_INDEX[crash.config]
    deadline = time.monotonic() + budget_s
    hang = crash.what.startswith("hung")

    def crashes(p):
        # A candidate needs the whole hang limit (or, for a crash, a few
        # seconds) to tell.
        if deadline - time.monotonic() < (args.timeout if hang else 10):
            return False
        code, _, _ = child(args, "--exec", "--seed", p.seed, "--config", cfg_index,
                           "--keep", ",".join(map(str, p.origin)), timeout=args.timeout)
        return code is None if hang else code is not None and code < 0

    prog = generate(crash.seed, args.max_stmts)
    if not crashes(prog):
        crash.what += " (not reproduced alone)"
        return
    small = shrink(prog, crashes, deadline)
    crash.reproducer = render_crash(small, ALL_CONFIGS[cfg_index], crash.what)
    crash.minimized_len, crash.original_len = len(small), len(prog)


def supervise(args, configs):
    """Checks seeds in worker processes (a crash or hang costs the worker,
    is recorded and the next worker resumes after it), then shrinks each
    group's first program and each crash in child processes."""
    start = time.monotonic()
    report = Report()
    # A timed run keeps its last 15% for shrinking, the largest groups first.
    check_until = None if args.seconds is None else time.time() + 0.85 * args.seconds
    end = None if args.seconds is None else start + args.seconds
    total = args.programs if args.programs is not None else 1 << 40
    skip, done_upto, last_log = set(), args.seed, start
    config_arg = ",".join(str(CONFIG_INDEX[c.name]) for c in configs)
    while done_upto < args.seed + total and (check_until is None or time.time() < check_until):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed", str(done_upto),
               "--programs", str(args.seed + total - done_upto), "--max-stmts", str(args.max_stmts),
               "--timeout", str(args.timeout), "--configs", config_arg,
               "--skip", ",".join(map(str, sorted(skip)))]
        if check_until is not None:
            cmd += ["--deadline", str(check_until)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # stderr is drained by a thread (a full pipe would block the worker).
        err_chunks = []
        drain = threading.Thread(target=lambda: err_chunks.extend(proc.stderr), daemon=True)
        drain.start()
        batch, config = [], None
        for line in proc.stdout:
            if not line.startswith(EVENT):
                continue
            event = json.loads(line[len(EVENT):])
            if "batch" in event:
                batch, config = event["batch"], None
            elif "config" in event:
                config = event["config"]
            elif "done" in event:
                report.checked(event["done"], event["runs"], event.get("tier1_syncs"))
                for f in event["failures"]:
                    report.add(f["seed"], f["config"], [Mismatch(**m) for m in f["mismatches"]])
                done_upto = max(done_upto, max(event["done"]) + 1)
                batch = []
                now = time.monotonic()
                if now - last_log > 30:
                    print(f"[{now - start:.0f} s] {report!r}", flush=True)
                    last_log = now
        code = proc.wait()
        drain.join()
        if code == 0 or not batch:
            if code != 0:
                print(f"difffuzz: a worker failed (exit {code}):\n{''.join(err_chunks)[-2000:]}", flush=True)
                break
            continue
        # The worker died inside a batch: faulthandler's traceback names the
        # program (<difffuzz seed=S ...>); else the whole batch is skipped.
        err = "".join(err_chunks)
        named = [int(n) for n in re.findall(r"<difffuzz seed=(\d+)", err) if int(n) in batch]
        culprits = named[:1] or batch
        what = (f"killed by signal {-code}" if code < 0 else
                "hung (timeout)" if "Timeout (" in err else f"exit {code}")
        where = "\n".join(ln for ln in err.splitlines()
                          if "Fatal Python error" in ln or "Timeout (" in ln or "<difffuzz seed=" in ln)
        for seed in culprits:
            report.crashes.append(Crash(seed, config if named else None, what, where or err[-2000:]))
            skip.add(seed)
        done_upto = max(done_upto, min(batch))
        print(f"difffuzz: seed {culprits[0]} {what} ({config}); resuming", flush=True)
    if not args.no_minimize:
        for item in report.crashes + report.by_size():
            # A crash's candidates each cost a process start: three times
            # the time.
            budget = args.minimize_seconds * (3 if isinstance(item, Crash) else 1)
            left = budget if end is None else min(budget, end - time.monotonic())
            if left <= 1:
                break
            if isinstance(item, Crash):
                shrink_crash(args, item, left)
                continue
            seed, cfg_name = item.where
            _, events, _ = child(args, "--minimize", "--seed", seed, "--config", CONFIG_INDEX[cfg_name],
                                 "--kind", item.signature[0], "--tag", item.signature[1],
                                 "--minimize-seconds", left, timeout=left + 120)
            for event in events:
                item.reproducer = event["reproducer"]
                item.minimized_len, item.original_len = event["minimized_len"], event["original_len"]
    report.seconds = time.monotonic() - start
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description="Differential fuzzing of mgpu against eager CPU.")
    p.add_argument("--seconds", type=float, help="run for this long (the last 15%% shrinking what was found)")
    p.add_argument("--programs", type=int, help="number of programs (seeds SEED, SEED+1, ...)")
    p.add_argument("--seed", type=int, help="first seed (default: 0 with --programs, else from the clock, "
                   "past HALF_SEEDS)")
    p.add_argument("--max-stmts", type=int, default=24, help="longest program (default 24)")
    p.add_argument("--configs", help=f"comma-separated indices (default: 0-{len(CONFIGS) - 1}): " +
                   "; ".join(f"{i}: {c.name}" for i, c in enumerate(ALL_CONFIGS)))
    p.add_argument("--no-minimize", action="store_true", help="report mismatches without shrinking them")
    p.add_argument("--minimize-seconds", type=float, default=60.0,
                   help="time to shrink one group (default 60; a crash gets three times that)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="a program run taking longer counts as a hang (default 300 s)")
    p.add_argument("--in-process", action="store_true",
                   help="run everything in this process (a crash then ends the run)")
    p.add_argument("--show", action="store_true", help="print the programs of --seed and --programs, run nothing")
    # Internal: what the child processes run.
    for flag in ("--worker", "--minimize", "--exec"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, kind in (("--deadline", float), ("--skip", str), ("--config", int), ("--kind", str),
                       ("--tag", str), ("--keep", str)):
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = 0 if args.seconds is None else HALF_SEEDS + int(time.time()) % 1_000_000
    if args.seconds is None and args.programs is None:
        args.programs = 1 if args.show else 100
    configs = CONFIGS if not args.configs else tuple(ALL_CONFIGS[int(i)] for i in args.configs.split(","))
    faulthandler.enable()
    if args.worker:
        return run_worker(args, configs)
    if args.minimize:
        return run_minimize(args)
    if args.exec:
        return run_exec(args)
    if args.show:
        for s in range(args.seed, args.seed + args.programs):
            print(f"# seed {s}\n{generate(s, args.max_stmts).source()}\n")
        return 0
    print(f"difffuzz: seeds from {args.seed}, configs: {', '.join(c.name for c in configs)}", flush=True)
    if args.in_process:
        seeds = itertools.count(args.seed) if args.programs is None else range(args.seed, args.seed + args.programs)
        seconds = None if args.seconds is None else 0.85 * args.seconds
        report = fuzz(seeds, configs, seconds=seconds, max_stmts=args.max_stmts,
                      minimize_groups=not args.no_minimize, minimize_budget_s=args.minimize_seconds,
                      minimize_total_s=None if args.seconds is None else 0.15 * args.seconds,
                      timeout_s=args.timeout, log=lambda s: print(s, flush=True))
    else:
        report = supervise(args, configs)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
