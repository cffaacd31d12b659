"""torch.compile(model, backend="mgpu"): inductor's kernels on mgpu's lanes.

The backend is inductor's own pipeline (`compile_fx`: AOTAutograd, its
decompositions, joint-graph passes and forward/backward split) with another
inner compiler. For each ATen graph it receives (forward, backward or
inference), the inner compiler splits the graph along its independent
branches (`_partition.split`), compiles every partition with inductor
(`compile_fx_inner`), and returns code that runs the partitions as nodes of
the lazy engine: each is one `torch_mgpu::partition` op, planned over the
lanes beside whatever eager mgpu code is pending.

- CPU inputs: the partitions run on the CPU lanes (inputs are wrapped as mgpu
  values without a copy, outputs come back as CPU tensors over the results'
  bytes). A graph with no branches worth a hand-off is one partition, called
  directly: inductor's code with no engine in between. Partitions of a split
  graph are compiled with the C++ wrapper, which lets go of the GIL, and
  with intra-op threads shared among the lanes.
- mgpu inputs: the graph is compiled for the CPU and every partition is
  recorded lazily, so compiled and eager code share one pending graph;
  outputs are mgpu tensors.
- CUDA inputs: compiled for CUDA; the partitions run in order on the current
  stream.
- Dynamic shapes: a graph with symbolic sizes is one partition (inductor's
  dynamic-shape code, called directly, or on a lane for mgpu inputs).
- Measured choice: a graph split into partitions for host or CUDA tensors
  is also compiled whole, as inductor alone would compile it. Over its first
  calls on host tensors the two take turns, timed, and the faster is kept
  (`compile_choices()`); the split is a prediction, the choice a measurement,
  so a split graph is not slower than inductor's own code. On CUDA tensors
  the whole graph runs (its partitions would run in order on one stream).
  `TORCH_MGPU_COMPILE_CHOICE=partitions` (or `whole`) fixes the choice.

Registered under the name "mgpu" through the `torch_dynamo_backends` entry
point (and on import of torch_mgpu).
"""
import copy
import functools
import itertools
import os
import re
import threading
import time
import weakref

import torch

from . import _C, _partition

_registry_lock = threading.Lock()
_partitions = weakref.WeakValueDictionary()  # name -> PartitionInfo
_graphs = weakref.WeakSet()  # every live CompiledGraph

# How a graph split into partitions runs on host tensors: "measure" times
# both ways over its first calls and keeps the faster; "partitions" and
# "whole" fix the choice. Read when a graph is compiled.
CHOICES = ("measure", "partitions", "whole")
CHOICE = _C._env_text("TORCH_MGPU_COMPILE_CHOICE") or "measure"
TRIALS = 5          # timed calls of each way (after an untimed first one)


class PartitionInfo:
    """What last_plan() tells about a partition: name, ops, kernels, its
    estimated work and how long it took to compile."""

    def __init__(self, handle, ops, kernels, work, compile_s):
        self.handle = handle
        self.name = handle.name
        self.ops = ops
        self.kernels = kernels
        self.work = work
        self.compile_s = compile_s


def partition_info(name: str):
    with _registry_lock:
        return _partitions.get(name)


def _is_mgpu(x):
    return isinstance(x, torch.Tensor) and x.device.type == "mgpu"


def _count_kernels(compiled) -> int:
    src = getattr(compiled, "source_code", "") or ""
    names = set(re.findall(r"\b(cpp_fused_\w+|triton_\w+)\b", src))
    externs = len(re.findall(r"extern_kernels\.\w+\(|aoti_torch_cpu_\w+\(|aoti_torch_cuda_\w+\(|at::\w+\(", src))
    return len(names) + externs


def _cpu_threads(lanes):
    return max(1, (os.cpu_count() or 1) // max(1, lanes))


class _Part:
    """One compiled partition of a graph."""

    def __init__(self, sub, inputs, outputs, example_inputs, kwargs, multi, lanes, node=True):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx_inner

        self.inputs = inputs    # FX nodes of the whole graph
        self.outputs = outputs
        self.ops = [_partition.op_name(n) for n in sub.graph.nodes if n.op == "call_function"
                    and n.target is not __import__("operator").getitem]
        work = {"gemm_flops": 0.0, "elem": 0.0, "transcendental": 0.0, "bytes": 0.0}
        for n in sub.graph.nodes:
            for k, v in _partition.node_work(n).items():
                work[k] += v
        self.work = work
        cpu = all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in example_inputs)
        patches = {}
        if multi and cpu:
            # Lanes call it side by side: the C++ wrapper lets go of the GIL,
            # and each call gets its share of the cores. Not where it checks
            # (a Cholesky's `_linalg_check_errors`): the C++ wrapper raises
            # the check's LinAlgError as a RuntimeError.
            effects = any(n.target is torch.ops.higher_order.with_effects for n in sub.graph.nodes)
            patches = {"cpp.threads": _cpu_threads(lanes)} if effects else \
                {"cpp_wrapper": True, "cpp.threads": _cpu_threads(lanes)}
        self.symbolic = _any_symbolic(example_inputs)
        if self.symbolic:
            # Inductor's FX graph cache, hit by a graph with symbolic sizes
            # compiled here (a backward's, on a second process's run), fails
            # evaluating the entry's guards (KeyError: 'args'): not cached.
            patches["fx_graph_cache"] = False
        t0 = time.perf_counter()
        with inductor_config.patch(patches):
            self.compiled = compile_fx_inner(sub, example_inputs,
                                             **dict(kwargs, cpp_wrapper=patches.get("cpp_wrapper", False)))
        self.compile_s = time.perf_counter() - t0
        self.kernels = _count_kernels(self.compiled)
        self.specs = [v if isinstance(v, torch.Tensor) else None for v in example_inputs]
        self.handle = None
        work = dict(work, threads=float(patches.get("cpp.threads", 0)))
        # A partition that reads no tensor (torch.eye, arange) takes an empty
        # one: the op finds its device (and the node its lane) from it.
        self.anchored = not any(isinstance(v, torch.Tensor) for v in example_inputs)
        if node and not self.symbolic:
            out_vals = [o.meta["val"] for o in outputs]
            specs = [_meta_like(v) for v in example_inputs if isinstance(v, torch.Tensor)]
            if self.anchored:
                specs.append(torch.empty(0, device="meta"))
            self.handle = _C._make_partition(self._run, self.ops, self.kernels, specs,
                                             [_meta_like(v) for v in out_vals], work)
            info = PartitionInfo(self.handle, self.ops, self.kernels, work, self.compile_s)
            with _registry_lock:
                _partitions[self.handle.name] = info
            self._info = info  # kept alive with the compiled graph

    def _run(self, tensors):
        """Called by the engine on a lane (with the GIL): CPU tensors in."""
        args = []
        if self.anchored:
            tensors = tensors[:-1]
        for t, spec in zip(tensors, self.specs):
            if spec is not None and t.stride() != spec.stride():
                t = torch.empty_strided(spec.shape, spec.stride(), dtype=t.dtype, device=t.device).copy_(t)
            args.append(t)
        return list(self.compiled(args))

    def __call__(self, args):
        """Runs it here, on host or CUDA tensors."""
        return list(self.compiled(list(args)))


def _strip_input_mutations(gm, placeholder_index):
    """Takes the graph's writes into its inputs (`copy_(input, value)`, as
    AOTAutograd leaves BatchNorm's running statistics in inference graphs)
    out of it: partitions are pure functions of their inputs. Returns
    (input index, value node) pairs, copied by the caller after the run."""
    mutations = []
    for n in list(gm.graph.nodes):
        if _writes_input(n, placeholder_index):
            dst, src = n.args[0], n.args[1]
            n.replace_all_uses_with(src)
            gm.graph.erase_node(n)
            mutations.append((placeholder_index[dst], src))
    if mutations:
        gm.graph.lint()
        gm.recompile()
    return mutations


def _writes_input(n, placeholder_index):
    """Whether node `n` writes an input of its graph (`copy_(input, value)`)."""
    return n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in placeholder_index


def _direct_call(part, placeholder_index, mutations, output_args):
    """How to call `part` alone for its graph: (part, the input of the
    graph for each of its inputs, each input it writes with the value
    written there, each output of the graph: one of the part's, an input,
    or a constant; None where they are the part's outputs in order)."""
    at = {n: k for k, n in enumerate(part.outputs)}

    def source(a):
        if isinstance(a, torch.fx.Node):
            return (0, at[a]) if a in at else (1, placeholder_index[a])
        return (2, a)
    inputs = [placeholder_index[i] for i in part.inputs]
    written = [(index, source(src)) for index, src in mutations]
    outputs = [source(a) for a in output_args]
    if outputs == [(0, k) for k in range(len(part.outputs))]:
        outputs = None
    return part, inputs, written, outputs


def _laid_out(t, stride):
    """Whether `t` has `stride` (where a dim has more than one element: a
    dim of one has any stride; a symbolic stride is not compared)."""
    return all(n <= 1 or not isinstance(b, int) or a == b for n, a, b in zip(t.shape, t.stride(), stride))


def _call_direct(direct, args):
    """On host or CUDA tensors: inductor's code (_direct_call), called with
    the inputs it was compiled for; written inputs take their new values;
    the outputs put in order."""
    part, inputs, written, outputs = direct
    outs = part.compiled([args[i] for i in inputs])
    for index, (kind, k) in written:
        args[index].copy_(outs[k] if kind == 0 else args[k])
    if outputs is None:
        return outs
    return [outs[k] if kind == 0 else args[k] if kind == 1 else k for kind, k in outputs]


def _has_symbols(t):
    return any(isinstance(s, torch.SymInt) for s in t.shape) or any(isinstance(s, torch.SymInt) for s in t.stride())


def _any_symbolic(values):
    """Whether any of `values` is a SymInt or a tensor of symbolic sizes or strides."""
    return any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and _has_symbols(v)) for v in values)


def _meta_like(v):
    return torch.empty_strided(tuple(int(s) for s in v.shape), tuple(int(s) for s in v.stride()),
                               dtype=v.dtype, device="meta")


class _Choice:
    """Which way a split graph runs on host tensors: its partitions on the
    lanes (0) or the whole graph as one inductor call (1), measured by the
    one trial rule (_C._Trial, csrc/ir/trial.h: the whole graph the
    baseline, the partitions kept only if _C._margin_partitions times
    faster). Until it is decided the calls take turns; each way's first
    call is cold (plans, caches) and not timed, then TRIALS timed calls
    each decide it."""

    NAMES = ("partitions", "whole")
    _WAY = (1, 0)  # the trial's way of each of NAMES: the whole graph is its baseline

    def __init__(self, mode):
        self.lock = threading.Lock()
        self.trial = _C._Trial(2, TRIALS, _C._margin_partitions)
        self.chosen = {"partitions": 0, "whole": 1}.get(mode)

    def next(self):
        """(the way to run, whether to time it)."""
        chosen = self.chosen
        if chosen is not None:
            return chosen, False
        with self.lock:
            way = self.trial.turn()
            return self._WAY.index(way), self.trial.call(way)

    def record(self, k, seconds):
        with self.lock:
            if self.chosen is not None:
                return
            self.trial.record(self._WAY[k], seconds)
            if self.trial.all_timed():
                self.chosen = 0 if self.trial.choose() == self._WAY[0] else 1

    def report(self):
        with self.lock:
            def median(k):
                way = self._WAY[k]
                return self.trial.median(way) if self.trial.timed_runs(way) else None
            return {"choice": None if self.chosen is None else self.NAMES[self.chosen],
                    "partitions_s": median(0), "whole_s": median(1)}


def compile_choices():
    """One dict per live graph compiled by the mgpu backend, oldest first:
    `id` (a number, larger for later graphs), `partitions` (how many it was
    split into), `choice` ("partitions", "whole", or None
    while the first calls measure both), and the measured medians
    `partitions_s` and `whole_s` (None until timed)."""
    with _registry_lock:
        graphs = list(_graphs)
    out = []
    for g in sorted(graphs, key=lambda g: g.serial):
        r = {"id": g.serial, "partitions": g.groups, "choice": "whole", "partitions_s": None, "whole_s": None}
        if g.choice is not None:
            r.update(g.choice.report())
        elif g.whole is None and len(g.parts) > 1:
            r["choice"] = "partitions"
        out.append(r)
    return out


_serial = itertools.count()


class CompiledGraph:
    """What the inner compiler returns: a boxed callable (AOTAutograd's
    calling convention) over the partitions of one graph."""

    def __init__(self, gm, example_inputs, kwargs, lazy_inputs=False):
        if CHOICE not in CHOICES:
            raise ValueError(f"TORCH_MGPU_COMPILE_CHOICE must be one of {', '.join(CHOICES)}, got {CHOICE!r}")
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__
        kwargs = dict(kwargs)
        static = set(kwargs.pop("static_input_idxs", ()) or ())
        kwargs.pop("cudagraphs", None)
        kwargs.pop("cpp_wrapper", None)
        kwargs.pop("fx_wrapper", None)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for p, v in zip(placeholders, example_inputs):
            # AOTAutograd restrides a backward's example inputs to the
            # layouts the forward's code gave its saved activations
            # (channels-last around convolutions), not its placeholders'
            # values. (With symbolic sizes every output keeps eager's
            # strides, below: the placeholders' values stand.)
            old = p.meta.get("val")
            if old is None or (isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and
                               not _has_symbols(old) and not _has_symbols(v) and v.stride() != old.stride()):
                p.meta["val"] = v
        self.placeholder_index = {n: i for i, n in enumerate(placeholders)}
        # On host or CUDA tensors, a graph that writes its inputs (an
        # optimizer's step, BatchNorm's statistics) runs whole with the
        # writes in its code, where inductor makes them in place: a copy of
        # it before they are taken out (partitions are pure functions).
        full = None
        if not lazy_inputs and any(_writes_input(n, self.placeholder_index) for n in gm.graph.nodes):
            full = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        self.mutations = _strip_input_mutations(gm, self.placeholder_index)
        _partition.untie_effects(gm)
        symbolic = _any_symbolic(p.meta.get("val") for p in placeholders)
        lanes = len(_C.lanes())
        groups = _partition.split(gm, 1 if symbolic else lanes)
        self.groups = len(groups)
        outside = _partition.used_outside(gm, groups) | {src for _, src in self.mutations}
        multi = len(groups) > 1
        from torch._guards import TracingContext

        def compile_part(members, kept, split, node=True, graph=gm, index=self.placeholder_index, visible=None):
            sub, ins, outs = _partition.subgraph(graph, members, kept, visible, whole=not node)
            sub_static = [k for k, i in enumerate(ins) if index.get(i) in static]
            # Each compile reports its own outputs' strides; the graph's are
            # reported below.
            with TracingContext.report_output_strides() as strides:
                part = _Part(sub, ins, outs, [i.meta["val"] for i in ins],
                             dict(kwargs, static_input_idxs=sub_static), split, lanes, node)
            part.output_strides = strides
            return part

        self.output_args = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        # A graph on host or CUDA tensors is compiled whole, as inductor
        # alone compiles it (a split one's cross-partition values stay
        # inside, fused as inductor fuses them; its writes are in place; its
        # saved activations in inductor's layouts); a split one also in
        # partitions, and its first calls choose. On mgpu inputs, the
        # partitions only: they join the pending graph.
        self.whole = self.choice = self._whole_call = None
        if not lazy_inputs:
            if full is not None:
                graph, index = full, {n: i for i, n in enumerate(n for n in full.graph.nodes if n.op == "placeholder")}
                written = []  # in its code
            else:
                graph, index, written = gm, self.placeholder_index, self.mutations
            members = [n for n in graph.graph.nodes if n.op in ("call_function", "get_attr")]
            kept = _partition.used_outside(graph, [members]) | {src for _, src in written}
            # Its outputs keep eager's strides where inductor alone would
            # (the model's outputs): saved activations take the layouts
            # inductor picks (channels-last around convolutions), reported
            # to the backward's compile below.
            output_node = next(n for n in graph.graph.nodes if n.op == "output")
            output_args = output_node.args[0]
            visible = None  # all: with symbolic sizes, eager's strides everywhere
            if "user_visible_output_idxs" in output_node.meta and not symbolic:
                visible = {output_args[k] for k in output_node.meta["user_visible_output_idxs"]}
            self.whole = compile_part(members, kept, False, node=False, graph=graph, index=index, visible=visible)
            self._whole_call = _direct_call(self.whole, index, written, output_args)
        self.parts = [compile_part(members, outside, multi) for members in groups] if lazy_inputs or multi else []
        if multi and self.whole is not None:
            on_cuda = any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in example_inputs)
            self.choice = _Choice("whole" if on_cuda else CHOICE)
        # One inductor call and nothing else: the whole graph's code, at
        # once where there is nothing to choose, else once it is chosen.
        self._direct = None
        if self.whole is not None and (self.choice is None or self.choice.chosen == 1):
            self._direct = self._whole_call
        elif len(self.parts) == 1:
            self._direct = _direct_call(self.parts[0], self.placeholder_index, self.mutations, self.output_args)
        # The graph's output strides: the whole graph's code's where it has
        # it (the partitions' outputs are laid out so, _outputs), else
        # eager's.
        whole_strides = [None] * len(self.output_args)
        if self.whole is not None and self.whole.output_strides:
            at = {n: j for j, n in enumerate(self.whole.outputs)}
            whole_strides = [self.whole.output_strides[at[a]] if isinstance(a, torch.fx.Node) and a in at else None
                             for a in output_args]  # the whole graph's outputs, in the graph's order
        self.output_strides = []
        for a, stride in zip(self.output_args, whole_strides):
            v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
            self.output_strides.append(stride if stride is not None else
                                       tuple(v.stride()) if isinstance(v, torch.Tensor) else None)
        context = TracingContext.try_get()
        if context is not None and context.output_strides is not None:
            context.output_strides.extend(self.output_strides)
        self.symbolic = symbolic
        self.serial = next(_serial)
        with _registry_lock:
            _graphs.add(self)

    # -- running ----------------------------------------------------------
    def __call__(self, args):
        on_cuda = False
        for a in args:
            if isinstance(a, torch.Tensor) and not a.is_cpu:
                if a.device.type == "mgpu":
                    return self._run_lazy(list(args))
                on_cuda = True
        if self._direct is not None:
            return _call_direct(self._direct, args)
        args = list(args)
        if on_cuda or self.symbolic:
            return self._run_direct(args, self.parts)
        if self.choice is None:
            return self._run_engine(args)
        k, timed = self.choice.next()
        t0 = time.perf_counter()
        out = self._run_engine(args) if k == 0 else self._run_whole(args)
        if timed:
            self.choice.record(k, time.perf_counter() - t0)
            if self.choice.chosen == 1:
                self._direct = self._whole_call
        return out

    def _value(self, node, args, env):
        if node in env:
            return env[node]
        return args[self.placeholder_index[node]]

    def _outputs(self, args, env, view=None):
        for index, src in self.mutations:
            v = env.get(src) if src in env else self._value(src, args, env)
            args[index].copy_(view(v) if view is not None and src in env else v)
        out = []
        for a, stride in zip(self.output_args, self.output_strides):
            if not isinstance(a, torch.fx.Node):
                out.append(a)
                continue
            v = view(env[a]) if view is not None and a in env else self._value(a, args, env)
            if stride is not None and isinstance(v, torch.Tensor) and not _laid_out(v, stride):
                # Laid out as the graph reported it (the whole graph's code's
                # layout, an input it returns converted included).
                v = torch.empty_strided(v.shape, stride, dtype=v.dtype, device=v.device).copy_(v)
            out.append(v)
        return out

    def _run_whole(self, args):
        """The whole graph's code, here (as its choice runs it)."""
        return _call_direct(self._whole_call, args)

    def _run_direct(self, args, parts):
        """Each of `parts` in turn, here: inductor's code and nothing else."""
        env = {}
        for part in parts:
            env.update(zip(part.outputs, part([self._value(i, args, env) for i in part.inputs])))
        return self._outputs(args, env)

    def _record(self, args, wrap, anchor):
        env = {}
        for part in self.parts:
            if part.handle is None:
                raise RuntimeError("mgpu: a compiled graph with symbolic sizes cannot run on mgpu tensors; "
                                   "compile it with dynamic=False")
            ins = [wrap(self._value(i, args, env)) for i in part.inputs]
            if part.anchored:
                ins.append(anchor())
            env.update(zip(part.outputs, _C._call_partition(part.handle, ins)))
        return env

    def _run_engine(self, args):
        """Host tensors in and out, the partitions planned over the lanes."""
        aliases = {}

        def wrap(t):
            if not isinstance(t, torch.Tensor) or _is_mgpu(t):
                return t
            if id(t) not in aliases:
                aliases[id(t)] = _C._alias_tensor(t)
            return aliases[id(t)]

        env = self._record(args, wrap, lambda: _C._alias_tensor(torch.empty(0)))
        return self._outputs(args, env, view=lambda v: _C._value_view(v, "cpu"))

    def _run_lazy(self, args):
        """mgpu tensors in and out: the partitions join the pending graph."""
        moved = {}

        def wrap(t):
            if not isinstance(t, torch.Tensor) or _is_mgpu(t):
                return t
            if id(t) not in moved:
                moved[id(t)] = t.to("mgpu")
            return moved[id(t)]

        return self._outputs(args, self._record(args, wrap, lambda: torch.empty(0, device="mgpu")))


def _inner_compile(gm, example_inputs, lazy_inputs=False, **kwargs):
    kwargs.pop("compile_region_name", None)
    return CompiledGraph(gm, example_inputs, kwargs, lazy_inputs)


def mgpu_backend(gm: torch.fx.GraphModule, example_inputs):
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    lazy_inputs = any(_is_mgpu(t) for t in example_inputs)
    if lazy_inputs:
        # mgpu tensors: compiled for the CPU, the lanes' device; the
        # partitions always join the pending graph (nothing to choose).
        gm, example_inputs = _for_cpu(gm, example_inputs)
    inner = functools.partial(_inner_compile, lazy_inputs=lazy_inputs)  # the backward's too
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner)


def _cpu_device(x):
    if isinstance(x, torch.device) and x.type == "mgpu":
        return torch.device("cpu")
    if isinstance(x, str) and x.startswith("mgpu"):
        return "cpu"
    return x


def _for_cpu(gm, example_inputs):
    """The graph and its example inputs with mgpu replaced by the CPU."""
    from torch._guards import detect_fake_mode
    from torch.utils._pytree import tree_map

    fake_mode = detect_fake_mode(example_inputs)
    cpu_inputs = []
    for t in example_inputs:
        if _is_mgpu(t):
            with fake_mode:
                c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            if isinstance(t, torch.nn.Parameter):
                c = torch.nn.Parameter(c, requires_grad=t.requires_grad)
            else:
                c.requires_grad_(t.requires_grad)
            for attr in ("_dynamo_static_input_type",):
                if hasattr(t, attr):
                    setattr(c, attr, getattr(t, attr))
            t = c
        cpu_inputs.append(t)
    for n in gm.graph.nodes:
        n.args = tree_map(_cpu_device, n.args)
        n.kwargs = tree_map(_cpu_device, n.kwargs)
    gm.recompile()
    return gm, cpu_inputs


def register():
    from torch._dynamo import list_backends, register_backend

    if "mgpu" not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=mgpu_backend, name="mgpu")
