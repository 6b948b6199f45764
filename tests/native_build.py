"""The CPU variant of the compiled host path, built once per machine and source version (`native.build_cpu`;
with `FP8P_NATIVE_SANITIZE=1` the AddressSanitizer build, see docs/testing.md) and shared by the test files and
the xdist workers that call it: the first process builds it (about a minute), the others wait for that build
and load it. `FP8P_NATIVE_BUILD_DIR` names the directory; by default it is one in the temporary directory,
named after the sources, torch and Python, so an edit of the sources gets a fresh build."""
from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import sys
import tempfile
from typing import Optional

import torch

from fp8_parallel import native

_built: Optional[native.NativeOps] = None


def _build_key() -> str:
    digest = hashlib.sha256(f"{torch.__version__} {sys.version} {native.sanitized()}".encode())
    headers = glob.glob(os.path.join(os.path.dirname(native.sources()[0][0]), "*.h"))
    for path in sorted(native.sources()[0]) + sorted(headers):
        with open(path, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()[:16]


def build_directory() -> str:
    """Where the shared CPU build lives (`FP8P_NATIVE_BUILD_DIR`, else a per-user, per-version temporary one)."""
    given = os.environ.get("FP8P_NATIVE_BUILD_DIR")
    if given:
        return given
    return os.path.join(tempfile.gettempdir(), f"fp8p_native_{os.getuid()}_{_build_key()}")


def cpu_extension() -> native.NativeOps:
    """The CPU build of `fp8_parallel/csrc`, built by the first process that asks and reused by the others."""
    global _built
    if _built is None:
        directory = build_directory()
        os.makedirs(directory, exist_ok=True)
        # One process at a time runs torch's builder here. This lock ends with its holder, even a killed one;
        # torch's own lock file would then stay behind and make every later build wait forever, so it is
        # removed while this lock is held (no other builder can be inside then).
        with open(os.path.join(directory, "fp8p.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                for stale in (os.path.join(directory, "lock"), os.path.join(directory, "sanitize", "lock")):
                    if os.path.exists(stale):
                        os.remove(stale)
                _built = native.build_cpu(directory)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return _built
