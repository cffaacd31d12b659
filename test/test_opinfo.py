"""PyTorch's OpInfo database against mgpu: the pass rate goal and no crash.
A sample passes when its values and its layout are eager's."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def run_harness(report, every, min_pass_rate, *flags):
    r = subprocess.run([sys.executable, os.path.join(HERE, "opinfo_harness.py"), *flags, "--every", every,
                        "--report", str(report), "--min-pass-rate", str(min_pass_rate)],
                       capture_output=True, text=True, timeout=1200)
    print(r.stdout, r.stderr[-2000:])
    header = report.read_text().splitlines()[0]
    assert r.returncode == 0, header
    assert "0 crashed or hung" in header


def test_opinfo_conformance(tmp_path):
    run_harness(tmp_path / "opinfo_report.txt", os.environ.get("TORCH_MGPU_OPINFO_EVERY", "1"), 0.99)


def test_opinfo_conformance_noncontiguous(tmp_path):
    # The same samples as non-contiguous views (a third of the ops here;
    # `bash scripts/dev.sh opinfo --noncontiguous` runs them all).
    run_harness(tmp_path / "opinfo_report_noncontiguous.txt",
                os.environ.get("TORCH_MGPU_OPINFO_NONCONTIGUOUS_EVERY", "3"), 0.99, "--noncontiguous")


def test_opinfo_conformance_column_major(tmp_path):
    # Dense inputs that are not contiguous: where a result's layout follows
    # its inputs' (half of the ops here; `--transposed` runs them all).
    run_harness(tmp_path / "opinfo_report_column_major.txt",
                os.environ.get("TORCH_MGPU_OPINFO_TRANSPOSED_EVERY", "2"), 0.99, "--transposed")


def test_opinfo_conformance_large_path_column_major(tmp_path):
    # Every call recorded as calls above 16,384 elements are (Meta kernels,
    # the checks over a copy cut to 2 per dim in the call's order of dims),
    # column-major inputs: results' strides from the cut run (a third of the
    # ops; `--transposed --large-path` runs them all: 99.1% pass).
    run_harness(tmp_path / "opinfo_report_large_path.txt",
                os.environ.get("TORCH_MGPU_OPINFO_LARGE_PATH_EVERY", "3"), 0.98, "--transposed", "--large-path")


# Other dtypes (a quarter of the ops each; `bash scripts/dev.sh opinfo --dtype
# int64` runs them all): integer, complex and half-precision kernels, and
# the dtypes of results (int64 and bool run only there: float32 lacks them).
@pytest.mark.parametrize("dtype,mode", [("int64", ""), ("complex64", ""), ("float16", ""),
                                        ("complex64", "--transposed")])
def test_opinfo_conformance_other_dtypes(tmp_path, dtype, mode):
    every = os.environ.get("TORCH_MGPU_OPINFO_DTYPES_EVERY", "4")
    run_harness(tmp_path / f"opinfo_report_{dtype}.txt", every, 0.99, "--dtype", dtype, *([mode] if mode else []))


@pytest.mark.parametrize("dtype", ["float32", "complex64"])
def test_opinfo_conformance_inplace(tmp_path, dtype):
    # Every op's in-place variant (x.sin_(), x.conj_physical_()): the written
    # input and the result. Every one passes (a few seconds): none may fail.
    run_harness(tmp_path / f"opinfo_report_inplace_{dtype}.txt", "1", 1.0, "--inplace", "--dtype", dtype)


def test_opinfo_conformance_gradients(tmp_path):
    # Backward through each sample (a third of the ops; `--grad` runs them
    # all): the gradients of its leaves under the same random output weights.
    every = os.environ.get("TORCH_MGPU_OPINFO_GRAD_EVERY", "3")
    run_harness(tmp_path / "opinfo_report_grad.txt", every, 0.99, "--grad")


def test_a_result_laid_out_otherwise_is_a_mismatch():
    sys.path.insert(0, HERE)
    import opinfo_harness

    x = torch.randn(3, 4)
    opinfo_harness.compare_layouts(x, x.to("mgpu"))
    opinfo_harness.compare_layouts((x, x.t()), [x.to("mgpu"), x.t().to("mgpu")])
    # A dimension of length one has no stride that matters.
    opinfo_harness.compare_layouts(torch.randn(3, 1), torch.empty_strided((3, 1), (1, 5), device="mgpu"))
    with pytest.raises(AssertionError, match="strides differ"):
        opinfo_harness.compare_layouts(x, x.t().contiguous().t().to("mgpu"))
    assert opinfo_harness.column_major(x).stride() == (1, 3)
    assert torch.equal(opinfo_harness.column_major(x), x)


def test_a_wrong_gradient_is_a_mismatch():
    sys.path.insert(0, HERE)
    import opinfo_harness
    from torch.testing._internal.opinfo.core import SampleInput

    x = torch.randn(3, 4, requires_grad=True)
    same = opinfo_harness.compare_gradients(lambda t: (t * 2).sum(1), SampleInput(x), False)
    assert same == ("pass", "")
    # a backward that differs on mgpu: its gradient is 3, eager's 2
    skewed = opinfo_harness.compare_gradients(lambda t: t * (2 if t.device.type == "cpu" else 3), SampleInput(x), False)
    assert skewed[0] == "mismatch", skewed
    # an op whose output needs no gradient has nothing to compare
    assert opinfo_harness.compare_gradients(lambda t: t.detach() + 1, SampleInput(x), False)[0] == "cpu_error"
