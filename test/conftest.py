import contextlib
import os

import pytest
import torch

import torch_mgpu  # noqa: F401  (registers the mgpu device)

# The cost model calibrates once per process, on first use: here, on a quiet
# machine, not while a test has inductor's compile workers starting (rates
# measured then are off by 5-100x, and plans follow them).
torch_mgpu._C._cost_model()

# Plans follow the cost model, and a model calibrated on a busy machine (CI's
# are) moves 2-10x with the load: a test asserting a plan's shape would pass
# or fail with it. So tests plan under a pinned model, these figures of a
# quiet 2-core machine (no refinement by measured times while pinned), on CPU
# lanes; a test that takes `calibrated_model` plans under this machine's
# calibration and asserts only what holds under any.
REFERENCE_MODEL = dict(
    gemm_flops_per_s=1.0e11, small_gemm_flops_per_s=1.0e11, elem_per_s=1.0e10, transcendental_per_s=4.0e8,
    bytes_per_s=1.25e11, op_overhead_s=1.2e-6, lane_sync_s=1.4e-5, launch_s=5.5e-5,
    parallel_min_flops=8.19e6, parallel_efficiency=0.9)


@pytest.fixture(autouse=True)
def _clean_state():
    torch_mgpu.synchronize()
    yield
    # Work a test left pending (in the background too) runs here; an error
    # it raises fails the test that recorded it.
    torch_mgpu.synchronize()


def restore_lanes(lanes, policy):
    """Configures the lanes named by an earlier torch_mgpu.lanes() again
    (CPU devices, virtual or not, or CUDA devices), with `policy`."""
    torch_mgpu.configure(**torch_mgpu._configuration_of(lanes, policy))


def on_cuda_lanes():
    """Whether mgpu runs on CUDA streams (the default where a GPU is)."""
    return torch_mgpu.lanes()[0].startswith("cuda")


def pin_reference_model():
    """Plans from now on follow REFERENCE_MODEL (on CPU lanes; CUDA lanes
    keep their device's calibration)."""
    if not on_cuda_lanes():
        torch_mgpu._C._pin_cost_model(REFERENCE_MODEL)


pin_reference_model()

# Running a repeated trace at its call is a choice by measured time (on by
# default, "auto"): a test that runs a loop and asserts what the lazy path
# did (plans, tiers, flights) would follow the machine's load. Tests record
# lazily unless TORCH_MGPU_AT_CALL says otherwise; test_at_call.py sets
# each mode it tests.
if "TORCH_MGPU_AT_CALL" not in os.environ:
    torch_mgpu._C._set_at_call("off")


@pytest.fixture
def node_by_node():
    """Tier 0 (nodes on the lanes), whatever the default: a test of what
    nodes do (their faults, their streams) that runs one graph many times
    would otherwise find it hot and compiled (tier 1, on by default), with
    no node left to fail or to drop a wait. Tests of compiled code turn
    tier 1 back on themselves."""
    hits = torch_mgpu._C._tier_compile_hits()
    torch_mgpu.configure(compile=0)
    yield
    torch_mgpu.configure(compile=hits)


@pytest.fixture
def calibrated_model():
    """Plans under this machine's calibrated model, refined by measured
    times, for the test: the path users run."""
    pinned = torch_mgpu._C._cost_model_pinned()
    torch_mgpu._C._pin_cost_model(None)
    yield
    if pinned:
        pin_reference_model()


# How close a result of CUDA lanes is to eager CPU's (a GPU's kernels round
# differently); CPU lanes are bitwise equal.
CUDA_LANES_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def same_values(got, want):
    """Bitwise equal on CPU lanes, whose kernels are eager CPU's; close on
    CUDA lanes."""
    if not on_cuda_lanes():
        return torch.equal(got, want)
    return torch.allclose(got, want, **CUDA_LANES_TOLERANCE)


@pytest.fixture
def cpu_lanes():
    """CPU lanes for the test (where a GPU is, the default lanes are CUDA
    streams): for expectations about host memory and host threads."""
    saved = torch_mgpu.configuration()
    if on_cuda_lanes():
        torch_mgpu.configure(devices=["cpu"])
    yield
    torch_mgpu.configure(**saved)


def eager_on_lanes_device(fn, *cpu_tensors):
    """fn run eagerly on the lanes' device (the CPU, or the GPU of CUDA
    lanes), brought to the host: the kernels mgpu's lanes run. For results
    that amplify rounding (chains of products and tanh), where a GPU's
    result and the CPU's part ways."""
    device = torch_mgpu.lanes()[0].split("/")[0] if on_cuda_lanes() else "cpu"
    out = fn(*(t.to(device) for t in cpu_tensors))
    return out.cpu()


def assert_same(mgpu_tensor, cpu_tensor, exact=True):
    """The mgpu tensor, brought to the host, equals the eager CPU result:
    bitwise on CPU lanes (exact), close on CUDA lanes."""
    assert mgpu_tensor.device.type == "mgpu", mgpu_tensor.device
    got = mgpu_tensor.cpu()
    assert got.shape == cpu_tensor.shape and got.dtype == cpu_tensor.dtype
    if exact and not on_cuda_lanes():
        assert torch.equal(got, cpu_tensor), (got, cpu_tensor)
    elif exact:
        torch.testing.assert_close(got, cpu_tensor, **CUDA_LANES_TOLERANCE)
    else:
        torch.testing.assert_close(got, cpu_tensor)


def run_in_threads(work, n):
    """Runs work(0) .. work(n - 1), each on a thread of its own, side by side;
    raises the first error any of them raised, once all are done."""
    import threading
    errors = []

    def guarded(i):
        try:
            work(i)
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)
    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def random_dag_program(rng, n_inputs, n_ops):
    """A random DAG of ops over a pool of values; returns a function of the inputs."""
    ops = []
    for _ in range(n_ops):
        kind = rng.choice(["add", "mul", "tanh", "mm", "sub_", "sum_keep", "view_t"])
        ops.append((kind, rng.randrange(10 ** 6), rng.randrange(10 ** 6)))

    def run(inputs):
        pool = list(inputs)
        for kind, a, b in ops:
            x, y = pool[a % len(pool)], pool[b % len(pool)]
            if kind == "add":
                pool.append(x + y)
            elif kind == "mul":
                pool.append(x * y * 0.5)
            elif kind == "tanh":
                pool.append(torch.tanh(x))
            elif kind == "mm":
                pool.append(torch.tanh(x @ y))
            elif kind == "sub_":
                z = x.clone()
                z.sub_(y * 0.25)
                pool.append(z)
            elif kind == "sum_keep":
                pool.append(x.sum(0, keepdim=True).expand_as(x) / x.shape[0])
            else:
                pool.append(x.t().contiguous())
        return pool[len(inputs):]

    return run


@contextlib.contextmanager
def async_ops(n):
    """Background execution after `n` pending ops (0: off) within the block."""
    before = torch_mgpu.async_ops()
    torch_mgpu.set_async_ops(n)
    try:
        yield
    finally:
        torch_mgpu.set_async_ops(before)


def run_hot(f, cpu, mg=None, atol=1e-4, runs=4, exact=False):
    """Runs `f` (returning a tuple, or one tensor) on the CPU tensors `cpu`
    and on mgpu (the tensors `mg`, or `cpu` moved there afresh each run)
    `runs` times, each result against eager's (`exact`: equal in values and
    dtype); with tier 1 on, the graph gets hot after two runs, whose
    compiles are waited for. Returns the tier of each run."""
    def as_tuple(r):
        return r if isinstance(r, tuple) else (r,)
    tiers = []
    for k in range(runs):
        want = as_tuple(f(*cpu))
        got = as_tuple(f(*(mg if mg is not None else [t.to("mgpu") for t in cpu])))
        for n, (w, t) in enumerate(zip(want, got)):
            if exact:
                t = t.cpu()
                assert w.dtype == t.dtype and torch.equal(t, w), (k, n, (t.double() - w.double()).abs().max())
            else:
                torch.testing.assert_close(t.cpu(), w, rtol=1e-4, atol=atol, equal_nan=True)
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    return tiers
