"""`import torch` loads the mgpu device through the `torch.backends` entry
point (no `import torch_mgpu`); TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns it off,
as PyTorch documents. torch.compile finds the "mgpu" backend through its
`torch_dynamo_backends` entry point."""
import os
import subprocess
import sys

import pytest


def environ(**env):
    """This process's environment with autoloading at PyTorch's default (on)
    whatever the caller set, and env on top."""
    base = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    return dict(base, **env)


def run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=environ(**env), cwd=os.path.dirname(os.path.abspath(__file__)) + "/..")


def test_import_torch_is_enough():
    out = run("import sys, torch\n"
              "loaded, dynamo = 'torch_mgpu' in sys.modules, 'torch._dynamo' in sys.modules\n"
              "x = torch.randn(3, device='mgpu')\n"
              "print(x.device, torch.equal((x * 2).cpu(), x.cpu() * 2), loaded, dynamo)\n")
    assert out.returncode == 0, out.stderr[-3000:]
    # Autoloading does not pull in dynamo (it would double import torch's cost).
    assert out.stdout.split() == ["mgpu:0", "True", "True", "False"], out.stdout


def test_autoload_off():
    out = run("import sys, torch\n"
              "print('torch_mgpu' in sys.modules)\n"
              "try:\n"
              "    torch.randn(3, device='mgpu')\n"
              "except RuntimeError as e:\n"
              "    print('refused', 'mgpu' in str(e))\n", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "refused", "True"], out.stdout


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_compile_backend_found_through_its_entry_point(autoload):
    out = run("import torch, torch_mgpu\n"
              "f = torch.compile(lambda a: torch.tanh(a @ a) + 1, backend='mgpu')\n"
              "x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))\n"
              # tanh(.) + 1 near 0 for saturated entries: an absolute tolerance
              "print(torch.allclose(f(x.to('mgpu')).cpu(), torch.tanh(x @ x) + 1, atol=1e-5))\n",
              TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True"], out.stdout


def test_importing_torch_mgpu_first():
    # torch's import (and its autoload of torch_mgpu) then runs inside
    # torch_mgpu's own import.
    out = run("import torch_mgpu, torch\n"
              "print(torch.randn(2, device='mgpu').device, torch_mgpu.lanes() != [])\n")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["mgpu:0", "True"], out.stdout


def test_a_broken_torch_mgpu_never_stops_import_torch(tmp_path):
    # A source checkout without its built library, run from inside it,
    # shadows the installed package: torch imports, warns why and what to do.
    pkg = tmp_path / "torch_mgpu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('torch_mgpu._C is not built')\n")
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.ones(2).sum().item())"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=environ(PYTHONWARNINGS="default"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["2.0"]
    assert "torch_mgpu could not be loaded" in out.stderr and "torch_mgpu._C is not built" in out.stderr
    assert str(pkg) in out.stderr and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in out.stderr
