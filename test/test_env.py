"""Environment variables: one table (csrc/ir/env.cpp), read nowhere else,
listed in README, and a bad value raises a clear error naming the variable
at the import of torch_mgpu (never a crash where it is read)."""
import os
import re
import subprocess
import sys

import pytest

import torch_mgpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _files(folder, ends):
    for d, _, names in os.walk(os.path.join(ROOT, folder)):
        for n in names:
            if n.endswith(ends):
                yield os.path.join(d, n)


def test_only_the_table_reads_the_environment():
    readers = [os.path.relpath(p, ROOT) for p in _files("csrc", (".cpp", ".h"))
               if re.search(r"\bgetenv\s*\(", open(p).read())]
    assert readers == ["csrc/ir/env.cpp"], readers
    python = [os.path.relpath(p, ROOT) for p in _files("torch_mgpu", ".py")
              if re.search(r"os\.environ[^\n]*TORCH_MGPU_|getenv\([^\n]*TORCH_MGPU_", open(p).read())]
    assert python == [], python


def test_every_variable_named_in_the_code_is_in_the_table():
    table = {name for name, _, _ in torch_mgpu._C._env_table()}
    named = set()
    for p in list(_files("csrc", (".cpp", ".h"))) + list(_files("torch_mgpu", ".py")):
        named |= set(re.findall(r'"(TORCH_MGPU_[A-Z_0-9]+)"', open(p).read()))
    assert named <= table, named - table


def test_readme_lists_the_table():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(TORCH_MGPU_[A-Z_0-9]+)` \| ([^|]*) \|", section, re.M)
    want = [(name, fallback) for name, fallback, _ in torch_mgpu._C._env_table()]
    assert [(n, d.strip()) for n, d in rows] == want


def test_python_reads_only_the_tables_variables():
    assert torch_mgpu._C._env_text("TORCH_MGPU_COMPILE_CHOICE") == os.environ.get("TORCH_MGPU_COMPILE_CHOICE")
    with pytest.raises(ValueError, match="TORCH_MGPU_NOT_A_VARIABLE is not one of its environment variables"):
        torch_mgpu._C._env_text("TORCH_MGPU_NOT_A_VARIABLE")


BAD_VALUES = [
    ("TORCH_MGPU_SPIN_US", "fast", "TORCH_MGPU_SPIN_US='fast' is not an integer of at least 0"),
    ("TORCH_MGPU_ASYNC_OPS", "-3", "TORCH_MGPU_ASYNC_OPS='-3' is not an integer of at least 0"),
    ("TORCH_MGPU_MAX_PENDING", "0", "TORCH_MGPU_MAX_PENDING='0' is not an integer of at least 1"),
    ("TORCH_MGPU_HOST_CACHE_MB", "1.5", "TORCH_MGPU_HOST_CACHE_MB='1.5' is not an integer of at least 0"),
    ("TORCH_MGPU_LANES", "two", "TORCH_MGPU_LANES='two' is not an integer of at least 1"),
    ("TORCH_MGPU_POLICY", "fastest", "TORCH_MGPU_POLICY: unknown value 'fastest' (expected one of auto, heft, serial)"),
    ("TORCH_MGPU_COMPILE", "sometimes", "TORCH_MGPU_COMPILE='sometimes' is not an integer of at least 0"),
    ("TORCH_MGPU_SYNC", "sometimes", "TORCH_MGPU_SYNC: unknown value 'sometimes' (expected one of graph, op)"),
    ("TORCH_MGPU_FULL_PROBE_NUMEL", "", "TORCH_MGPU_FULL_PROBE_NUMEL='' is not an integer of at least 0"),
    ("TORCH_MGPU_COMPILE_CHOICE", "best", "TORCH_MGPU_COMPILE_CHOICE: unknown value 'best'"),
    ("TORCH_MGPU_AT_CALL", "sometimes", "TORCH_MGPU_AT_CALL: unknown value 'sometimes' (expected one of auto, on, off)"),
    ("TORCH_MGPU_REMOTE_TIMEOUT", "-1", "TORCH_MGPU_REMOTE_TIMEOUT must be a positive number of seconds, got '-1'"),
    ("TORCH_MGPU_NETWORK_GBPS", "fast", "TORCH_MGPU_NETWORK_GBPS must be a positive number of GB/s, got 'fast'"),
    ("TORCH_MGPU_NETWORK_LATENCY_US", "0", "TORCH_MGPU_NETWORK_LATENCY_US must be a positive number of us, got '0'"),
    ("TORCH_MGPU_WORKER_THREADS", "0", "TORCH_MGPU_WORKER_THREADS='0' is not an integer of at least 1"),
]


def test_every_variable_the_table_parses_has_a_bad_value_here():
    # The table says how each variable is read (csrc/ir/env.cpp); check_all
    # refuses every one of them at import: each is tried below.
    assert sorted(torch_mgpu._C._env_checked()) == sorted(name for name, _, _ in BAD_VALUES)


@pytest.mark.parametrize("name, value, words", BAD_VALUES)
def test_a_bad_value_raises_at_import_naming_the_variable(name, value, words):
    code = ("import torch\n"
            "try:\n"
            "    import torch_mgpu\n"
            "    print((torch.ones(3, device='mgpu') + 1).cpu().tolist())\n"
            "except (ValueError, RuntimeError) as e:\n"
            "    print(type(e).__name__, str(e).splitlines()[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **{name: value}))
    assert out.returncode == 0, out.stderr[-2000:]
    assert words in out.stdout, out.stdout + out.stderr[-2000:]


def test_good_values_are_taken():
    code = ("import torch, torch_mgpu\n"
            "print(torch_mgpu.async_ops(), torch_mgpu.max_pending_ops(), torch_mgpu.policy(),\n"
            "      (torch.ones(3, device='mgpu') + 1).cpu().tolist())\n")
    env = dict(os.environ, TORCH_MGPU_SPIN_US="0", TORCH_MGPU_ASYNC_OPS="7", TORCH_MGPU_MAX_PENDING="55",
               TORCH_MGPU_POLICY="serial", TORCH_MGPU_COMPILE="on", TORCH_MGPU_HOST_CACHE_MB="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["7", "55", "serial", "[2.0,", "2.0,", "2.0]"], out.stdout
