"""Thin driver: builds the native extension ``moe_extension._C`` through CMake.

CMakeLists.txt is the one native build. This file only finds torch's CMake config, decides whether the
CUDA sources are compiled (when the installed torch is a CUDA build, unless MOE_EXT_FORCE_CPU=1), and
places the built library where ``import moe_extension`` finds it (also for ``pip install -e .``).

Environment knobs:
  TORCH_CUDA_ARCH_LIST   CUDA targets, torch's syntax (default "8.0;9.0"; e.g. "9.0a" for Hopper only)
  MOE_EXT_FORCE_CPU=1    build the CPU kernels only, even with a CUDA torch
  MAX_JOBS               parallel compile jobs (default: CPU count)
  MOE_EXT_BUILD_TYPE     CMake build type (default Release)
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def _loaded_libstdcxx() -> str:
    """Path of the shared libstdc++ this process (with torch imported) runs on, "" when there is none.

    _C must bind to that library rather than to whatever its compiler links by default: a compiler that
    only has libstdc++.a (the GPU machine's CXX) would otherwise copy libstdc++'s code into _C.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ""
    for line in maps.splitlines():
        path = line.split()[-1]
        if "/libstdc++.so" in path:
            return path
    return ""


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        with_cuda = torch.version.cuda is not None and os.environ.get("MOE_EXT_FORCE_CPU", "0") != "1"
        env = dict(os.environ)
        if with_cuda:
            env.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={os.environ.get('MOE_EXT_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DMOE_EXT_OUTPUT_DIR={out_dir}",
            f"-DMOE_EXT_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
            f"-DMOE_EXT_LIBSTDCXX={_loaded_libstdcxx()}",
        ]
        if self._has_ninja():
            args += ["-G", "Ninja"]
        subprocess.check_call(args, env=env)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--parallel", jobs], env=env)

    @staticmethod
    def _has_ninja() -> bool:
        try:
            subprocess.check_output(["ninja", "--version"])
            return True
        except (OSError, subprocess.CalledProcessError):
            return False


setup(
    ext_modules=[CMakeExtension("moe_extension._C")],
    cmdclass={"build_ext": CMakeBuild},
)
