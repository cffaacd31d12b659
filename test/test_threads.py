"""Python threads against the engine: a monitoring thread beside a capturing
one, storages dying on other threads, and a random stress of every public
function. Each runs in a child process under a watchdog (faulthandler), so a
deadlock fails the test with every thread's stack instead of hanging."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run(scenario, seconds, threads, **env):
    out = subprocess.run([sys.executable, os.path.join(HERE, "stress_threads.py"), scenario, str(seconds), str(threads)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-6000:]}"
    assert out.stdout.startswith("ok"), out.stdout
    return out.stdout


def test_monitoring_thread_beside_capture_of_new_signatures():
    # Capture runs Python Meta kernels under the engine lock while the
    # other thread holds the GIL and asks for lanes(), stats(), last_plan()...
    run("monitor", 3, 2)


def test_storages_dying_on_other_threads():
    run("deleters", 3, 4)


@pytest.mark.parametrize("async_ops", ["0", "16"])
def test_random_stress_of_every_public_function(async_ops):
    run("stress", 5, 4, TORCH_MGPU_ASYNC_OPS=async_ops)
