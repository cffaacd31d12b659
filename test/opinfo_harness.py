"""Conformance against PyTorch's own OpInfo database.

Runs every float32 (or --dtype) sample input of every op in
`torch.testing._internal.common_methods_invocations.op_db` on mgpu and on
CPU, and compares. Writes per-op counts (pass, mismatch, error, crash) to a
report file and prints the pass rate over the ops that run on CPU.

    python test/opinfo_harness.py                  # every op (minutes)
    python test/opinfo_harness.py --every 6        # a bounded subset (CI)
    python test/opinfo_harness.py --ops add,mm     # named ops
    python test/opinfo_harness.py --noncontiguous  # each sample's tensors as non-contiguous views
    python test/opinfo_harness.py --transposed     # each sample's tensors laid out column-major
    python test/opinfo_harness.py --dtype int64    # the samples of another dtype
    python test/opinfo_harness.py --grad           # gradients: backward through each sample
    python test/opinfo_harness.py --inplace        # the ops' in-place variants (x.add_(y))
    python test/opinfo_harness.py --transposed --large-path
        # every call takes the path of calls above 16,384 elements (Meta
        # kernels, the checks over a cut copy), whatever the samples' sizes

A result matches when its values do and its layout does: the strides of
every dimension longer than one are eager's (a later `view` succeeds or
fails on mgpu as it does in eager).

Ops run in worker processes: a crash or hang is recorded against the op that
caused it and a new worker takes the next op.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Ops whose results are random draws: compared by shape and dtype only.
RANDOM_OPS = {
    "bernoulli", "normal", "uniform", "multinomial", "randint_like", "rand_like", "randn_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "nn.functional.rrelu",
    "cauchy", "exponential", "geometric", "log_normal", "randint", "randn", "rand", "normal.number_mean",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "empty", "empty_like",
    "new_empty", "new_empty_strided", "empty_strided", "empty_permuted", "torch.empty", "bernoulli",
    "nn.functional.multi_head_attention_forward", "uniform", "pca_lowrank", "svd_lowrank",
}


LABELS = {"": "", "noncontiguous": " (non-contiguous inputs)", "transposed": " (column-major inputs)",
          "grad": " (gradients)", "inplace": " (in-place variants)"}


def op_key(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def column_major(t):
    """`t`'s values with its last two dimensions swapped in memory: dense,
    not contiguous (the layout of `x.t()` and of a transposed weight)."""
    import torch

    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dim() < 2 or t.requires_grad:
        return t
    return t.mT.contiguous().mT


def worker(names, mode="", dtype_name="float32"):
    import torch
    import torch_mgpu  # noqa: F401
    from torch.testing._internal.common_methods_invocations import op_db

    by_key = {op_key(op): op for op in op_db}
    for key in names:
        op = by_key[key]
        print(json.dumps({"start": key}), flush=True)
        res = {"op": key, "samples": 0, "pass": 0, "mismatch": 0, "error": 0, "cpu_error": 0, "first": ""}
        try:
            dtype = getattr(torch, dtype_name)
            if dtype not in op.supported_dtypes("cpu"):
                res["skipped"] = f"no {dtype_name} on cpu"
                print(json.dumps(res), flush=True)
                continue
            if mode == "grad" and (not op.supports_autograd or dtype not in op.supported_backward_dtypes("cpu")):
                res["skipped"] = f"no {dtype_name} backward on cpu"
                print(json.dumps(res), flush=True)
                continue
            if mode == "inplace" and op.inplace_variant is None:
                res["skipped"] = "no in-place variant"
                print(json.dumps(res), flush=True)
                continue
            samples = list(op.sample_inputs("cpu", dtype, requires_grad=mode == "grad"))
        except Exception as e:  # the database itself failed for this op
            res["skipped"] = f"sample generation failed: {type(e).__name__}"
            print(json.dumps(res), flush=True)
            continue
        for sample in samples:
            res["samples"] += 1
            if mode == "noncontiguous":
                # The same values through strided views (OpInfo's own
                # transform), for eager and for mgpu alike.
                try:
                    sample = sample.noncontiguous()
                except Exception:  # a sample the transform does not take (sparse inputs)
                    res["cpu_error"] += 1
                    continue
            if mode == "transposed":
                sample = sample.transform(column_major)
            if mode == "grad":
                outcome = compare_gradients(op, sample, key in RANDOM_OPS or op.name in RANDOM_OPS or
                                            sample.kwargs.get("dropout_p", 0) > 0)
                res[outcome[0]] += 1
                if outcome[1] and not res["first"]:
                    res["first"] = outcome[1]
                continue
            # Moved before eager runs: an op that writes its input (embedding_bag's
            # max_norm renormalizes the weight in place) must not hand mgpu
            # what eager left.
            moved = sample.transform(lambda t: to_mgpu(t) if isinstance(t, torch.Tensor) else t)
            fn = op
            if mode == "inplace":
                # The written input comes back as the result, so compares too.
                fn = op.inplace_variant
                if isinstance(sample.input, torch.Tensor):
                    sample.input = to_mgpu(sample.input, "cpu")
            torch.manual_seed(0)
            try:
                expected = fn(sample.input, *sample.args, **sample.kwargs)
            except Exception:
                res["cpu_error"] += 1
                continue
            if mode == "inplace":
                expected = (expected, sample.input)
            try:
                torch.manual_seed(0)
                on_device = fn(moved.input, *moved.args, **moved.kwargs)
                if mode == "inplace":
                    on_device = (on_device, moved.input)
                got = tree_to_cpu(on_device)
            except Exception as e:
                res["error"] += 1
                if not res["first"]:
                    res["first"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                continue
            try:
                random = key in RANDOM_OPS or op.name in RANDOM_OPS or sample.kwargs.get("dropout_p", 0) > 0
                compare(expected, got, random)
                compare_layouts(expected, on_device)
                res["pass"] += 1
            except Exception as e:
                res["mismatch"] += 1
                if not res["first"]:
                    res["first"] = f"mismatch: {str(e).splitlines()[0][:200]}"
        print(json.dumps(res), flush=True)


def compare_gradients(op, sample, random):
    """Backward through `sample` on CPU and on mgpu: the gradients of its
    leaves under the same random weights of its differentiable outputs.
    Returns (outcome key, first failure or "")."""
    import torch
    from torch.utils._pytree import tree_flatten

    def run(s):
        leaves = [t for t in tree_flatten((s.input, s.args, s.kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.manual_seed(0)
        outs = [o for o in tree_flatten(op(s.input, *s.args, **s.kwargs))[0]
                if isinstance(o, torch.Tensor) and o.requires_grad and (o.is_floating_point() or o.is_complex())]
        if not outs or not leaves:
            return None
        g = torch.Generator().manual_seed(1)
        # (weights on each output's own device: `to` may return a CPU tensor)
        loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)).sum().abs()
                   if o.is_complex() else (o * torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)).sum()
                   for o in outs)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [None if x is None else x.detach() for x in grads]

    try:
        expected = run(sample)
    except Exception:
        return "cpu_error", ""
    if expected is None:
        return "cpu_error", ""
    # Leaves of the same layout on mgpu (a leaf's storage moved whole, then
    # the same view of it, made a leaf again).
    moved = sample.transform(lambda t: to_mgpu(t.detach()).requires_grad_(t.requires_grad)
                             if isinstance(t, torch.Tensor) else t)
    try:
        got = run(moved)
        got = [None if x is None else x.cpu() for x in got]
    except Exception as e:
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    try:
        assert len(got) == len(expected), "gradient count differs"
        for e, g in zip(expected, got):
            assert (e is None) == (g is None), "a gradient is missing on one side"
            if e is not None:
                compare(e, g, random)
        return "pass", ""
    except Exception as e:
        return "mismatch", f"mismatch: {str(e).splitlines()[0][:200]}"


def to_mgpu(t, device="mgpu"):
    """`t` on mgpu (or a copy on `device`) with the same storage layout: its
    whole storage copied and the same view taken of it, so that
    storage-level ops (as_strided of a partial view, of a non-contiguous
    input) see what they see on CPU. `.to()` alone copies only the view,
    compactly, on any device."""
    import torch

    if t.layout != torch.strided or t.is_conj() or t.is_neg() or t.requires_grad or t.numel() == 0:
        return t.to(device, copy=True)
    st = t.untyped_storage()
    whole = torch.empty(0, dtype=t.dtype).set_(st, 0, (st.nbytes() // t.element_size(),), (1,))
    return whole.to(device, copy=True).as_strided(t.shape, t.stride(), t.storage_offset())


def tree_to_cpu(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.cpu() if x.device.type == "mgpu" else x
    if isinstance(x, (list, tuple)):
        return type(x)(tree_to_cpu(e) for e in x) if not hasattr(x, "_fields") else type(x)(*(tree_to_cpu(e) for e in x))
    return x


def compare(expected, got, shape_only):
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"expected a tensor, got {type(got)}"
        assert got.device.type == "cpu"
        if shape_only:
            assert expected.shape == got.shape and expected.dtype == got.dtype, "shape/dtype differ"
            return
        low = expected.dtype in (torch.float16, torch.bfloat16, torch.complex32)
        torch.testing.assert_close(got, expected, equal_nan=True, atol=None if low else 1e-4,
                                   rtol=None if low else 1e-4)
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(got), "length differs"
        for e, g in zip(expected, got):
            compare(e, g, shape_only)
    elif isinstance(expected, float) and expected != expected:
        assert got != got
    else:
        assert expected == got, f"{expected!r} != {got!r}"


def compare_layouts(expected, on_device):
    """The strides of every dimension longer than one, as eager's."""
    import torch

    if isinstance(expected, torch.Tensor):
        if expected.layout != torch.strided or on_device.layout != torch.strided or expected.numel() == 0:
            return
        for d, n in enumerate(expected.shape):
            assert n <= 1 or expected.stride(d) == on_device.stride(d), \
                f"strides differ: eager {expected.stride()}, mgpu {on_device.stride()} (shape {tuple(expected.shape)})"
    elif isinstance(expected, (list, tuple)) and isinstance(on_device, (list, tuple)):
        for e, g in zip(expected, on_device):
            compare_layouts(e, g)


def all_keys():
    out = subprocess.check_output(
        [sys.executable, "-c",
         "from torch.testing._internal.common_methods_invocations import op_db\n"
         "print('\\n'.join(o.name + ('.' + o.variant_test_name if o.variant_test_name else '') for o in op_db))"],
        text=True)
    return [l for l in out.splitlines() if l]


def drive(keys, timeout, mode="", dtype_name="float32"):
    """Runs `keys` in workers; a worker that dies or stalls is charged to its
    current op and replaced by a new worker for the remaining ops."""
    import queue
    import threading

    results = {}
    todo = list(keys)
    while todo:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", ",".join(todo)]
                                + (["--" + mode] if mode else []) + ["--dtype", dtype_name],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        lines = queue.Queue()

        def pump(stream=proc.stdout):
            for line in stream:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, hung = None, False
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                proc.kill()
                hung = True
                break
            if line is None:
                break
            msg = json.loads(line)
            if "start" in msg:
                current = msg["start"]
            else:
                results[msg["op"]] = msg
                current = None
        proc.wait()
        if current is not None and current not in results:
            results[current] = {"op": current, "samples": 0, "pass": 0, "mismatch": 0, "error": 0,
                                "cpu_error": 0, "crash": 1,
                                "first": "hang" if hung else f"crash (exit {proc.returncode})"}
        elif current is None and proc.returncode != 0 and not hung:
            # Died between ops: charge the next op so that progress is made.
            nxt = next((k for k in todo if k not in results), None)
            if nxt:
                results[nxt] = {"op": nxt, "samples": 0, "pass": 0, "mismatch": 0, "error": 0, "cpu_error": 0,
                                "crash": 1, "first": f"crash (exit {proc.returncode})"}
        todo = [k for k in todo if k not in results]
    return results


def summarize(results, report, mode="", dtype_name="float32"):
    ran = [r for r in results.values() if not r.get("skipped") and r["samples"] > r["cpu_error"]]
    passed = [r for r in ran if r["pass"] == r["samples"] - r["cpu_error"] and not r.get("crash")]
    crashes = [r for r in results.values() if r.get("crash")]
    with open(report, "w") as f:
        f.write(f"# mgpu OpInfo conformance{LABELS[mode]}: "
                f"{len(passed)}/{len(ran)} ops pass all {dtype_name} samples "
                f"({100.0 * len(passed) / max(1, len(ran)):.1f}%), {len(crashes)} crashed or hung\n")
        f.write("# op samples pass mismatch error cpu_error crash first_failure\n")
        for k in sorted(results):
            r = results[k]
            if r.get("skipped"):
                f.write(f"{k} skipped: {r['skipped']}\n")
                continue
            f.write(f"{k} {r['samples']} {r['pass']} {r['mismatch']} {r['error']} {r['cpu_error']} "
                    f"{r.get('crash', 0)} {r['first']}\n")
    return len(passed), len(ran), len(crashes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--ops", help="comma-separated op names")
    ap.add_argument("--every", type=int, default=1, help="take every k-th op (bounded subset)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds without progress = hang")
    ap.add_argument("--report", default=os.path.join(HERE, "opinfo_report.txt"))
    ap.add_argument("--min-pass-rate", type=float, default=0.0)
    ap.add_argument("--noncontiguous", action="store_true", help="non-contiguous views of every sample")
    ap.add_argument("--transposed", action="store_true", help="every sample's tensors laid out column-major")
    ap.add_argument("--dtype", default="float32", help="the samples' dtype (a torch attribute: float64, int64, ...)")
    ap.add_argument("--grad", action="store_true", help="gradients of every sample's leaves, by backward")
    ap.add_argument("--inplace", action="store_true", help="the in-place variants (x.add_(y)) of the ops with one")
    ap.add_argument("--large-path", action="store_true",
                    help="every call recorded as calls above 16,384 elements are (TORCH_MGPU_FULL_PROBE_NUMEL=0)")
    a = ap.parse_args()
    if a.large_path:
        os.environ["TORCH_MGPU_FULL_PROBE_NUMEL"] = "0"  # the workers inherit it
    mode = ("noncontiguous" if a.noncontiguous else "transposed" if a.transposed else "grad" if a.grad else
            "inplace" if a.inplace else "")
    if a.worker:
        worker(a.worker.split(","), mode, a.dtype)
        return 0
    keys = all_keys()
    if a.ops:
        wanted = set(a.ops.split(","))
        keys = [k for k in keys if k in wanted or k.split(".")[0] in wanted]
    keys = keys[:: a.every]
    t0 = time.time()
    results = drive(keys, a.timeout, mode, a.dtype)
    p, n, c = summarize(results, a.report, mode, a.dtype)
    rate = p / max(1, n)
    print(f"OpInfo{LABELS[mode]}: {p}/{n} ops pass all {a.dtype} samples ({100 * rate:.1f}%), {c} crashed or hung, "
          f"{time.time() - t0:.0f}s; report in {a.report}")
    return 0 if rate >= a.min_pass_rate and c == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
