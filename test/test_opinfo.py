"""PyTorch's OpInfo database against mgpu: the pass rate goal and no crash."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_opinfo_conformance(tmp_path):
    report = tmp_path / "opinfo_report.txt"
    every = os.environ.get("TORCH_MGPU_OPINFO_EVERY", "1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "opinfo_harness.py"), "--every", every,
                        "--report", str(report), "--min-pass-rate", "0.9"],
                       capture_output=True, text=True, timeout=1200)
    print(r.stdout, r.stderr[-2000:])
    header = report.read_text().splitlines()[0]
    assert r.returncode == 0, header
    assert "0 crashed or hung" in header


def test_opinfo_conformance_noncontiguous(tmp_path):
    # The same samples as non-contiguous views (a third of the ops here;
    # `bash scripts/dev.sh opinfo --noncontiguous` runs them all).
    report = tmp_path / "opinfo_report_noncontiguous.txt"
    every = os.environ.get("TORCH_MGPU_OPINFO_NONCONTIGUOUS_EVERY", "3")
    r = subprocess.run([sys.executable, os.path.join(HERE, "opinfo_harness.py"), "--noncontiguous", "--every", every,
                        "--report", str(report), "--min-pass-rate", "0.97"],
                       capture_output=True, text=True, timeout=1200)
    print(r.stdout, r.stderr[-2000:])
    header = report.read_text().splitlines()[0]
    assert r.returncode == 0, header
    assert "0 crashed or hung" in header
