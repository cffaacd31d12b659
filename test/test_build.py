"""The build links libstdc++ as PyTorch does, whatever the compiler's folders hold.

A GCC whose own folder holds libstdc++.a without libstdc++.so (one GPU image's
/opt/gcc) linked the archive into libtorch_mgpu.so: a second libstdc++ beside
the libstdc++.so.6 PyTorch loads, and writing a number into a stream from the
library crashed. Such a compiler is simulated here by a wrapper around the
system's g++ that answers -print-file-name as that one does and puts a folder
holding only the archive on the linker's path.
"""
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("g++") is None or shutil.which("cmake") is None,
    reason="needs Linux, g++ and cmake")


def _archive():
    out = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(out):
        pytest.skip("this g++ has no libstdc++.a")
    return out


# libstdc++'s own code (stream insertion, locales, code conversion), by mangled
# name: binutils versions demangle these differently.
LIBSTDCXX_CODE = (" _ZNSo9_M_insert", " _ZNSt6locale", " _ZNSt7codecvt")


def _defines_libstdcxx(lib):
    nm = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    return [l for l in nm.splitlines() if any(code in l for code in LIBSTDCXX_CODE)]


def _needed(lib):
    dyn = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
    return "libstdc++.so" in dyn


@pytest.mark.parametrize("use_the_module", [False, True])
def test_a_compiler_with_only_the_static_libstdcxx_links_the_shared_one(tmp_path, use_the_module):
    fake = tmp_path / "gcc-without-shared-runtime"
    (fake / "lib").mkdir(parents=True)
    os.symlink(_archive(), fake / "lib" / "libstdc++.a")
    cxx = fake / "g++"
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in "$@"; do
          case "$a" in
            -print-file-name=libstdc++.so|-print-file-name=libstdc++.so.6) echo "${{a#-print-file-name=}}"; exit 0 ;;
            -print-file-name=libstdc++.a) echo "{fake}/lib/libstdc++.a"; exit 0 ;;
          esac
        done
        exec g++ "$@" -L"{fake}/lib"
        """))
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    src = tmp_path / "src"
    src.mkdir()
    (src / "number.cpp").write_text(textwrap.dedent("""\
        #include <sstream>
        #include <string>
        std::string number_text(long x) { std::ostringstream s; s << x; return s.str(); }
        """))
    (src / "CMakeLists.txt").write_text(textwrap.dedent(f"""\
        cmake_minimum_required(VERSION 3.18)
        project(number CXX)
        include("{ROOT}/cmake/SharedLibstdcxx.cmake")
        if(USE_THE_MODULE)
          mgpu_use_shared_libstdcxx()
        endif()
        add_library(number SHARED number.cpp)
        """))
    build = tmp_path / "build"
    env = dict(os.environ, CXX=str(cxx))
    cfg = subprocess.run(["cmake", "-S", str(src), "-B", str(build), f"-DUSE_THE_MODULE={int(use_the_module)}"],
                         capture_output=True, text=True, env=env)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    made = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True, env=env)
    assert made.returncode == 0, made.stdout + made.stderr
    lib = str(build / "libnumber.so")
    if use_the_module:
        assert "libstdc++ linked shared from" in cfg.stdout
        assert _defines_libstdcxx(lib) == []
        assert _needed(lib)
    else:
        # The simulation is the fault: the archive's stream code is inside.
        assert _defines_libstdcxx(lib) != []


def test_the_system_compiler_is_left_as_it_is(tmp_path):
    # Where libstdc++.so sits beside the archive (a distribution's GCC), the
    # module changes nothing.
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(textwrap.dedent(f"""\
        cmake_minimum_required(VERSION 3.18)
        project(plain CXX)
        include("{ROOT}/cmake/SharedLibstdcxx.cmake")
        mgpu_use_shared_libstdcxx()
        get_directory_property(opts LINK_OPTIONS)
        message(STATUS "link options: [${{opts}}]")
        """))
    shared = subprocess.run(["g++", "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(shared):
        pytest.skip("this g++ has no libstdc++.so of its own")
    cfg = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "build")], capture_output=True, text=True,
                         env=dict(os.environ, CXX="g++"))
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    assert "link options: []" in cfg.stdout
