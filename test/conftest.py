import contextlib

import pytest
import torch

import torch_mgpu  # noqa: F401  (registers the mgpu device)

# The cost model calibrates once per process, on first use: here, on a quiet
# machine, not while a test has inductor's compile workers starting (rates
# measured then are off by 5-100x, and plans follow them).
torch_mgpu._C._cost_model()


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


def assert_same(mgpu_tensor, cpu_tensor, exact=True):
    """The mgpu tensor, brought to the host, equals the eager CPU result."""
    assert mgpu_tensor.device.type == "mgpu", mgpu_tensor.device
    got = mgpu_tensor.cpu()
    assert got.shape == cpu_tensor.shape and got.dtype == cpu_tensor.dtype
    if exact:
        assert torch.equal(got, cpu_tensor), (got, cpu_tensor)
    else:
        torch.testing.assert_close(got, cpu_tensor)


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
