"""megatron-core's dataset index caches (`*.npy` under the cache directory), loaded with pickle disallowed.

megatron-core 0.16 reads its cached index arrays with `numpy.load(path, allow_pickle=True, mmap_mode="r")`:
`GPTDataset._build_document_sample_shuffle_indices` (document, sample and shuffle index), `BlendedDataset.
_build_indices` (dataset and dataset-sample index), `MaskedWordPieceDataset._build_sample_index`, and the
lazy loads of `GPTDataset._query_document_sample_shuffle_indices` / `BlendedDataset.__getitem__` (only with
`defer_npy_index_mmap`, which the job leaves off). numpy unpickles a file that is not in `.npy` format, so a
file planted in the cache directory under a cache name would run its payload.

`no_pickle_index_loads()` gives those megatron modules, for the duration of dataset building, a `numpy` whose
`load` never unpickles and passes only plain numeric arrays; anything else raises `IndexCacheError` naming the
file. numpy itself, and every other module's view of it, stays as it is.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import types
from typing import Iterator, List, Tuple

import numpy

from .datapath import DataError

# The megatron-core modules that load index caches with `numpy.load` (tests/test_index_cache.py checks that no
# other module of megatron.core.datasets calls it).
MEGATRON_CACHE_MODULES = (
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.datasets.blended_dataset",
    "megatron.core.datasets.masked_dataset",
)

# dtype kinds of a plain numeric array: bool, signed and unsigned integers, floats
_PLAIN_KINDS = "biuf"


class IndexCacheError(DataError):
    """A cached index file that is not a plain numeric `.npy` array (pickled, object or structured data)."""


def _refusal(file, what: str) -> IndexCacheError:
    return IndexCacheError(f"refusing to load the dataset index cache {os.fspath(file)}: {what}; it was not "
                           "written by megatron-core's index builder (delete it, and the job rebuilds it)")


def check_plain_array(file, value) -> numpy.ndarray:
    """`value` (loaded from `file`) when it is an array of a plain numeric dtype.

    Raises:
        IndexCacheError: an archive, an object array, or a structured / string / datetime dtype.
    """
    if not isinstance(value, numpy.ndarray):
        if hasattr(value, "close"):
            value.close()
        raise _refusal(file, f"it holds a {type(value).__name__}, not a .npy array")
    if value.dtype.kind not in _PLAIN_KINDS or value.dtype.fields is not None:
        raise _refusal(file, f"its dtype {value.dtype} is not a plain numeric one")
    return value


def load_plain_array(file, mmap_mode=None, **kwargs) -> numpy.ndarray:
    """`numpy.load(file, ...)` with pickle always off (an `allow_pickle` argument is ignored); only a plain
    numeric array passes.

    Raises:
        IndexCacheError: pickled data, an object dtype, a malformed file, or a non-numeric array.
    """
    kwargs.pop("allow_pickle", None)
    try:
        value = numpy.load(file, mmap_mode=mmap_mode, allow_pickle=False, **kwargs)
    except (ValueError, EOFError) as err:  # numpy's refusal of pickled / object data, or a malformed file
        raise _refusal(file, " ".join(str(err).split())) from err
    return check_plain_array(file, value)


class _NoPickleNumpy(types.ModuleType):
    """numpy as megatron's dataset modules see it while they build: `load` is `load_plain_array`."""

    def __init__(self) -> None:
        super().__init__("numpy")
        self.load = load_plain_array

    def __getattr__(self, name: str):
        return getattr(numpy, name)


def _cache_modules() -> List[types.ModuleType]:
    """megatron's cache-loading modules, each checked to name numpy as `numpy` (the attribute replaced)."""
    modules = [importlib.import_module(name) for name in MEGATRON_CACHE_MODULES]
    for module in modules:
        if getattr(module, "numpy", None) is not numpy:
            raise RuntimeError(f"{module.__name__} does not use numpy as `numpy`: the job cannot load its index "
                               "caches without pickle (megatron-core's dataset code changed)")
    return modules


@contextlib.contextmanager
def no_pickle_index_loads() -> Iterator[None]:
    """Within the block, megatron's dataset modules load index caches with `load_plain_array`."""
    saved: List[Tuple[types.ModuleType, object]] = [(m, m.numpy) for m in _cache_modules()]
    guarded = _NoPickleNumpy()
    for module, _ in saved:
        module.numpy = guarded
    try:
        yield
    finally:
        for module, original in saved:
            module.numpy = original
