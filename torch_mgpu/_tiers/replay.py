"""A recorded graph replayed as a function of its leaves' bytes (replay_fn),
and the geometry helpers that place its views."""
import torch

from .common import Unsupported, _op_for_args, is_contiguous
from .numerics import (_REDUCES_IN_OUT_DTYPE, _call_eager_formula, _compute_dtype, _eager_formula, _number_rounding,
                       _result_dtypes, _rounded, _unary_formula)


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


def _tensor_refs(node):
    """The tensor arguments of a recorded node: Refs (operand, geometry, tag),
    or None for a hole of a Tensor?[] list."""
    for _, _, kind, value in node["args"]:
        if kind == "t":
            yield value
        elif kind != "c":
            yield from value


def replay_fn(req, subst=None):
    """The graph as a function of its leaves' bytes (flat tensors),
    returning the roots: a fresh output as the op returned it, a storage
    written in place as its flat bytes. `subst`: (node, argument) -> a
    value traced in place of that constant."""
    graph = _Graph(req, subst or {})

    def run(*leaves):
        return _Replay(graph, leaves).run()

    return run


class _Graph:
    """What replay_fn reads off the recorded graph once, for every run."""

    def __init__(self, req, subst):
        self.subst = subst
        # A device argument was recorded as the host (mgpu's values live on
        # the lanes): the lanes' device, as tier 0 runs it.
        self.lanes_device = torch.device(req.get("device", "cpu"))
        self.n_leaves = len(req["leaves"])
        self.nodes = nodes = req["nodes"]
        self.roots = req["roots"]
        # Where each value is last read, so a write copies only what is read after.
        self.last_read = {}
        for i, node in enumerate(nodes):
            for v in node["operands"]:
                self.last_read[v] = i
        self.root_set = set(self.roots)
        self.ops = [_op_for_args(n) for n in nodes]
        self.formulas = {i: f for i, n in enumerate(nodes) for f in [_eager_formula(n, self.lanes_device) or _unary_formula(n)]
                         if f is not None}
        # Values that are new versions of a storage (in-place writes): a root
        # of them is returned as the storage's flat bytes.
        self.written_nbytes = {value: nbytes for n in nodes for value, mutated, _, nbytes, _ in n["outputs"]
                               if mutated >= 0}
        # Products whose result is floating or complex (see the integer 0 below).
        self.float_products = {i for i, n in enumerate(nodes) if n["op"] in ("aten::mul", "aten::mul_") and any(
            dt.is_floating_point or dt.is_complex for dt in _result_dtypes(n))}
        # A varying alpha of add/sub (SGD's `p.add_(g, alpha=-lr)` under a
        # schedule) is a Scalar argument, which compiled code can only bake in:
        # such a node is traced as add/sub of `other * alpha`, whose number is a
        # Tensor operand the constant's input can take the place of. (Eager's
        # kernel rounds once, a fused multiply-add; inductor's code for the
        # baked alpha multiplies and adds too.) Not for a half dtype, whose
        # product would be rounded between the two.
        varying = {tuple(v) for v in req.get("varying", ())}
        self.alpha_factor = {
            i: k for i, k in varying if nodes[i]["op"] in ("aten::add", "aten::add_", "aten::sub", "aten::sub_")
            and nodes[i]["args"][k].name == "alpha" and _compute_dtype(nodes[i]) in (torch.float32, torch.float64)}
        # The numbers eager rounds to a half dtype, rounded here, before
        # tracing (rounding while tracing would record the rounding's ops).
        self.rounded = {(i, k): _rounded(value, dt) for i, dt in _number_rounding(nodes).items()
                        for k, (_, _, kind, value) in enumerate(nodes[i]["args"]) if kind == "c"}
        # Each value's storage size (a written one's: the storage's after the write).
        self.value_nbytes = {value: nbytes for n in nodes for value, _, _, nbytes, _ in n["outputs"]}


class _Replay:
    """One run of a _Graph over its leaves (traced by make_fx)."""

    def __init__(self, graph, leaves):
        self.graph = graph
        # value -> (base tensor, fresh geometry): a leaf's or a written
        # storage's flat bytes (fresh None), or a fresh output as the op
        # returned it, which the recording says lies in its storage as
        # `fresh` lays it out.
        self.env = {k: (leaves[k], None) for k in range(graph.n_leaves)}
        self.inputs = {id(leaf) for leaf in leaves}  # the graph's own inputs (for view())
        self.flat_of = {}  # fresh output -> its storage's bytes, laid out as recorded

    def run(self):
        """The roots, each node replayed in turn."""
        for i, (node, op) in enumerate(zip(self.graph.nodes, self.graph.ops)):
            self.step(i, node, op)
        return tuple(self.result(v) for v in self.graph.roots)

    def laid_out(self, v):
        """The bytes of the storage of `v`, a fresh output (or one
        written in place as itself, which keeps its fresh geometry):
        its values placed as its recorded geometry places them. The traced op's result
        need not be laid out so (a decomposition keeps its input's
        strides where the CPU kernel's result is contiguous, and
        inductor lays out its buffers as it likes), so a view that
        reads the storage by strides reads these bytes."""
        if v not in self.flat_of:
            base, (sizes, strides, offset) = self.env[v]
            flat = base.new_empty(self.graph.value_nbytes[v] // base.element_size())
            torch.as_strided(flat, sizes, strides, offset).copy_(base)
            self.flat_of[v] = flat
        return self.flat_of[v]

    def view(self, v, geom, written=False):
        base, fresh = self.env[v]
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
            if (foffset == offset == 0 and numel == fnumel and is_contiguous(fsizes, fstrides)
                    and is_contiguous(sizes, strides)):
                # The same elements in the same order (view, flatten,
                # unsqueeze of a contiguous result): a reshape of the
                # values, whatever the traced result's layout.
                return base.reshape(sizes)
            perm = _permutation(fresh, (sizes, strides, offset))
            if perm is not None:
                return base.permute(perm)  # t(), transpose, permute: by the values too
            base = self.laid_out(v)
        if is_contiguous(sizes, strides) and offset + numel <= base.numel():
            # Views inductor follows better than as_strided.
            return base.narrow(0, offset, numel).view(sizes)
        # A buffer the graph made is read by views or a gather (see
        # _strided_read); one the op writes through the view must be
        # its bytes (as_strided).
        if not written and id(base) not in self.inputs:
            return _strided_read(base, sizes, strides, offset)
        return torch.as_strided(base, sizes, strides, offset)

    def step(self, i, node, op):
        """Node `i` replayed: its call, and its outputs into env."""
        env = self.env
        operands = node["operands"]
        grown, written = self.writes(i, node)
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
            t = self.view(operands[operand], grown.get(operand, geom), written=operand in written)
            if tag >= 0:
                same[tag] = t
            return t

        args, kwargs = self.arguments(i, node, tensor)
        _eager_arguments(node, args, kwargs)
        if i in self.graph.formulas:
            out = _call_eager_formula(self.graph.formulas[i], node["op"], args, kwargs)
        else:
            out = op(*args, **kwargs)
        for v, entry in saved.items():
            env[v] = entry
        flat = _flat_returns(out)
        for value, mutated, returned, _, geom in node["outputs"]:
            if mutated >= 0:
                env[value] = written[mutated]
            else:
                t = flat[returned]
                sizes, strides, offset, _ = geom
                if offset != 0:
                    raise Unsupported("a fresh output at an offset")
                env[value] = (t, (sizes, strides, offset))

    def writes(self, i, node):
        """(grown, written) for node `i`: the out= operands the op sizes,
        operand -> their geometry after the call, and the tensors the node
        writes into, mutated operand -> (base, fresh geometry)."""
        graph, env = self.graph, self.env
        operands = node["operands"]
        # out= tensors the op sizes (fresh and empty: the engine takes no
        # other): passed at their size after the call, in new bytes.
        grown = {}
        for arg, element, after in node.get("written", ()):
            kind, value = node["args"][arg].kind, node["args"][arg].value
            r = value if kind == "t" else value[element]
            if r is not None and tuple(r.geom[:3]) != tuple(after[:3]):
                grown[r.operand] = after
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
                elif fresh is not None and any(r is not None and r.operand == mutated and tuple(r.geom[:3]) != fresh
                                               for r in _tensor_refs(node)):
                    # Written through another view than the result
                    # itself: into its bytes, laid out as recorded (a copy).
                    base, fresh = self.laid_out(v).clone(), None
                elif v < graph.n_leaves or graph.last_read.get(v, -1) > i or v in graph.root_set:
                    base = torch.clone(base)
                written[mutated] = (base, fresh)
        return grown, written

    def arguments(self, i, node, tensor):
        """The call's (args, kwargs) for node `i`, its tensors by `tensor`."""
        graph = self.graph
        args, kwargs = [], {}
        for k, (name, kwarg_only, kind, value) in enumerate(node["args"]):
            if kind == "c":
                a = graph.subst.get((i, k), value)
                if isinstance(a, torch.device) and a.type == "cpu":
                    a = graph.lanes_device
                elif type(a) in (int, bool) and a == 0 and i in graph.float_products:
                    # Inductor folds a product with the integer 0 to 0,
                    # whatever the other factor: NaN * 0 and inf * 0
                    # would give 0, where eager gives NaN (difffuzz
                    # seed 3740135, `0 / x`: reciprocal(x) * 0; seed
                    # 3760406, `x * False`). The float 0.0 gives the
                    # same dtype and is not folded.
                    a = 0.0
                elif (i, k) in graph.rounded and (i, k) not in graph.subst:
                    # (A lifted one is traced as its stand-in and
                    # rounded where the compiled code is called.)
                    a = graph.rounded[(i, k)]
            elif kind == "t":
                a = tensor(value)
            else:
                a = [tensor(r) for r in value]
            if i in graph.alpha_factor and k == graph.alpha_factor[i] and i not in graph.formulas:
                args[1] = args[1] * a  # other * alpha, and no alpha
            elif kwarg_only:
                kwargs[name] = a
            else:
                args.append(a)
        return args, kwargs

    def result(self, v):
        base, fresh = self.env[v]
        if v in self.graph.written_nbytes and fresh is not None:
            # A write into a value the graph made: its storage's bytes,
            # as a leaf's are (flat), in the geometry it was made with.
            sizes, strides, offset = fresh
            flat = base.new_empty(self.graph.written_nbytes[v] // base.element_size())
            torch.as_strided(flat, sizes, strides, offset).copy_(base)
            return flat
        return base


def _eager_arguments(node, args, kwargs):
    """The call's arguments changed in place where the traced op would
    compute otherwise than eager's kernel."""
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


def _flat_returns(out):
    """The returns flattened as the recording numbered them: tensors
    and undefined ones (None: a backward's masked-out gradient)."""
    flat = []
    stack = [out]
    while stack:
        x = stack.pop(0)
        if isinstance(x, (list, tuple)):
            stack[:0] = list(x)
        elif isinstance(x, torch.Tensor) or x is None:
            flat.append(x)
    return flat
