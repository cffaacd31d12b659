"""Build driver: CMake is the source of truth, this only runs it.

Install with `pip install --no-build-isolation -e .` so that the build uses
the torch already installed (never a downloaded one).
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# The build imports torch: it must not autoload the torch_mgpu being rebuilt
# (a stale or missing build of it would make `import torch` fail).
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch

        import shutil
        import sysconfig

        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        pkg_dir = ROOT / "torch_mgpu"  # built in place; copied where setuptools wants it
        build_dir = Path(os.environ.get("TORCH_MGPU_BUILD_DIR", ROOT / "build"))
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = [
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={pkg_dir}",
            f"-DTORCH_MGPU_PY_SUFFIX={sysconfig.get_config_var('EXT_SUFFIX')}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('TORCH_MGPU_BUILD_TYPE', 'Release')}",
            f"-DTORCH_MGPU_BUILD_TESTS={os.environ.get('TORCH_MGPU_BUILD_TESTS', 'OFF')}",
            f"-DTORCH_MGPU_USE_CUDA={os.environ.get('TORCH_MGPU_USE_CUDA', 'OFF')}",
        ]
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir)] + cfg)
        jobs = os.environ.get("TORCH_MGPU_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])
        ext_path.parent.mkdir(parents=True, exist_ok=True)
        for f in ["libtorch_mgpu.so", ext_path.name]:
            if (pkg_dir / f).resolve() != (ext_path.parent / f).resolve():
                shutil.copy2(pkg_dir / f, ext_path.parent / f)


setup(
    name="torch_mgpu",
    version="0.1.0",
    description="Lazy mgpu device for PyTorch: records ops, runs independent branches in parallel",
    packages=["torch_mgpu", "torch_mgpu._tiers"],
    py_modules=["torch_mgpu_autoload"],
    package_data={"torch_mgpu": ["*.so"]},
    ext_modules=[CMakeExtension("torch_mgpu._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    entry_points={
        "torch_dynamo_backends": ["mgpu = torch_mgpu.compile:mgpu_backend"],
        # `import torch` loads the device (TORCH_DEVICE_BACKEND_AUTOLOAD=0: not).
        "torch.backends": ["torch_mgpu = torch_mgpu_autoload:load"],
    },
)
