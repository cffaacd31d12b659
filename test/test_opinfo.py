"""PyTorch's OpInfo database against mgpu: the pass rate goal and no crash."""
import os
import subprocess
import sys

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
