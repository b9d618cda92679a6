"""The build's one native step: pytest-boxlite's native pid 1 (``pytest_boxlite/guest/_init``).

Everything else is in ``pyproject.toml``.  Where a C compiler exists (Linux, x86_64 or aarch64),
``pip install .`` and ``pip install -e .`` build two files next to ``pytest_boxlite/guest``:

- ``_boxclone*.so``: ``box_clone``, loaded with ctypes by the warm interpreter (no Python API);
- ``_boxinit``: the box's pid 1, a freestanding static executable (no C library, runs in any box).

Without a compiler both steps only warn, and boxes run the pure-Python pid 1 (``doctor`` says which
one runs).
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools >= 70.1 carries bdist_wheel; older ones take it from the wheel package
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - old build environments
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

SRC = "pytest_boxlite/guest/_init"
NAME = "pytest_boxlite.guest._boxclone"
#: boxinit has no C library: no stack protector (it would read a thread pointer nothing set up),
#: no position independence (nothing relocates it), no unwind tables.
INIT_FLAGS = [
    "-O2",
    "-static",
    "-nostdlib",
    "-no-pie",
    "-fno-pic",
    "-ffreestanding",
    "-fno-stack-protector",
    "-fno-asynchronous-unwind-tables",
    "-fno-builtin",
]
NATIVE = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


class BuildNative(build_ext):
    """build_ext, then boxinit beside the extension; either failing only warns."""

    def run(self) -> None:
        super().run()
        if NATIVE:
            self._build_init()

    def _build_init(self) -> None:
        out = os.path.join(os.path.dirname(self.get_ext_fullpath(NAME)), "_boxinit")
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[:1] or ["cc"]
        cmd = [*cc, *INIT_FLAGS, "-o", out, os.path.join(SRC, "boxinit.c")]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.warn(f"pytest-boxlite: no native pid 1 ({exc}); boxes use the Python one")
            return
        if done.returncode != 0:
            self.warn(f"pytest-boxlite: no native pid 1 ({shlex.join(cmd)}: {done.stderr.strip()[-500:]})")
            if os.path.exists(out):
                os.unlink(out)

    def get_ext_filename(self, fullname: str) -> str:
        # No Python ABI in the name: the library uses no Python API (ctypes loads it), so one file
        # serves every interpreter (guest/__init__.py finds it as ``_boxclone*.so``).
        name = super().get_ext_filename(fullname)
        return os.path.join(os.path.dirname(name), "_boxclone.so") if fullname.endswith("_boxclone") else name

    def get_outputs(self) -> list[str]:
        outputs = list(super().get_outputs())
        if NATIVE:
            outputs.append(os.path.join(os.path.dirname(self.get_ext_fullpath(NAME)), "_boxinit"))
        return outputs


class PlatformWheel(bdist_wheel):
    """A wheel tagged ``py3-none-<platform>``: its native files are a ctypes library and a static
    executable, tied to the platform but to no Python version or ABI (``auditwheel repair`` then
    gives the platform its manylinux tag)."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


ext_modules = []
if NATIVE:
    ext_modules.append(
        Extension(
            NAME,
            sources=[f"{SRC}/boxclone.c"],
            depends=[f"{SRC}/sys.h", f"{SRC}/boxinit.c"],
            # Optional: without a compiler the build warns and the Python pid 1 runs.
            optional=True,
        )
    )

# The C sources go into the sdist (MANIFEST.in), not into the wheel.
setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildNative, "bdist_wheel": PlatformWheel},
    include_package_data=False,
)
