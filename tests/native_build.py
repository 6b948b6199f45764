"""The CPU variant of the compiled host path, built once per test process (`native.build_cpu`; with
`FP8P_NATIVE_SANITIZE=1` the AddressSanitizer build, see docs/testing.md) and shared by the test files that
call it."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from types import ModuleType
from typing import Optional

from fp8_parallel import native

_built: Optional[ModuleType] = None


def cpu_extension() -> ModuleType:
    """The CPU build of `fp8_parallel/csrc` (about a minute the first time in a process)."""
    global _built
    if _built is None:
        directory = tempfile.mkdtemp(prefix="fp8p_native_build_")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        _built = native.build_cpu(directory)
    return _built
