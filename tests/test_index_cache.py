"""The job's dataset index caches load without pickle: a planted cache file is refused, its payload never runs."""
from __future__ import annotations

import pathlib
import pickle
import random
import types
from pathlib import Path
from typing import List, Optional

import numpy
import pytest

from seeds import session_seed


class _Payload:
    """Unpickling it creates `marker` (what a planted cache file's code would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


@pytest.fixture
def one_rank_group(tmp_path):
    """A single-rank gloo group, as the job builds its data in (megatron's blend asks for the rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _write_corpus(prefix: Path, seed: int) -> str:
    from launch.train.indexed import write_indexed_dataset

    rng = random.Random(seed)
    docs = [[rng.randrange(256) for _ in range(rng.randint(8, 40))] for _ in range(60)]
    write_indexed_dataset(str(prefix), docs, dtype=numpy.uint16, eod=256)
    return str(prefix)


def _job_args(data_path: List[str], cache: Optional[Path]) -> types.SimpleNamespace:
    """The flags `build_train_dataset` reads."""
    return types.SimpleNamespace(seed=session_seed(), seq_length=16, data_path=data_path, split="1,0,0",
                                 data_cache_path=None if cache is None else str(cache), train_iters=2,
                                 global_batch_size=4)


def _build(args):
    from launch.train.data import build_train_dataset
    from launch.train.tokenizer import ByteTokenizer

    return build_train_dataset(args, ByteTokenizer())


def _build_error(args) -> Optional[Exception]:
    """What building the data raises (None: nothing)."""
    try:
        _build(args)
    except Exception as err:
        return err
    return None


def _plant(path: Path, kind: str, marker: Path) -> None:
    """Replace the cache file `path` by a pickled object array (a raw pickle, or a `.npy` of object dtype)."""
    payload = numpy.array([_Payload(marker)], dtype=object)
    if kind == "pickle":
        path.write_bytes(pickle.dumps(payload))
    else:
        with open(path, "wb") as f:
            numpy.save(f, payload, allow_pickle=True)


def _samples(dataset) -> List[List[int]]:
    return [dataset[i]["tokens"].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("kind", ["pickle", "object_npy"])
@pytest.mark.parametrize("layout", ["default_cache_gpt", "cache_path_blend"])
def test_planted_index_cache_is_refused_never_unpickled(tmp_path, one_rank_group, layout, kind):
    """Build the caches, replace one `.npy` by a pickled payload, build again: the payload does not run, the
    error names the file, and with the file deleted the job rebuilds the same samples."""
    seed = session_seed()
    if layout == "default_cache_gpt":  # no --data-cache-path: megatron's PREFIX/cache/GPTDataset_indices/
        args = _job_args([_write_corpus(tmp_path / "data" / "a", seed)], None)
        cache, name = tmp_path / "data" / "a" / "cache", "*-GPTDataset-train-shuffle_index.npy"
    else:  # a weighted blend of two datasets with --data-cache-path: the blend's own index caches too
        prefixes = [_write_corpus(tmp_path / "data" / p, seed + i) for i, p in enumerate("ab")]
        args = _job_args(["0.3", prefixes[0], "0.7", prefixes[1]], tmp_path / "cache")
        cache, name = tmp_path / "cache", "*-BlendedDataset-train-dataset_index.npy"
    expected = _samples(_build(args))
    (target,) = sorted(cache.rglob(name))
    marker = tmp_path / "payload_ran"
    _plant(target, kind, marker)

    from launch.train.indexcache import IndexCacheError

    err = _build_error(args)
    assert not marker.exists(), "unpickling the planted cache file ran its payload"
    assert isinstance(err, IndexCacheError) and str(target) in str(err), repr(err)
    assert "refusing to load the dataset index cache" in str(err)

    target.unlink()
    assert _samples(_build(args)) == expected
    assert not marker.exists()


def test_guard_leaves_numpy_and_restores_megatron():
    """The guard changes only megatron's dataset modules' `numpy`, and only within its block."""
    from launch.train.indexcache import MEGATRON_CACHE_MODULES, load_plain_array, no_pickle_index_loads

    import importlib

    modules = [importlib.import_module(name) for name in MEGATRON_CACHE_MODULES]
    load = numpy.load
    with no_pickle_index_loads():
        assert numpy.load is load
        assert all(m.numpy.load is load_plain_array and m.numpy.int64 is numpy.int64 for m in modules)
    assert all(m.numpy is numpy for m in modules)


def test_every_megatron_cache_load_is_guarded():
    """Each megatron.core.datasets module that calls `numpy.load` is one the guard covers."""
    import megatron.core.datasets as datasets

    from launch.train.indexcache import MEGATRON_CACHE_MODULES

    root = Path(datasets.__file__).parent
    loading = {"megatron.core.datasets." + ".".join(p.relative_to(root).with_suffix("").parts)
               for p in root.rglob("*.py") if "numpy.load(" in p.read_text() or "np.load(" in p.read_text()}
    assert loading == set(MEGATRON_CACHE_MODULES)


def test_plain_arrays_pass_and_others_are_refused(tmp_path):
    from launch.train.indexcache import IndexCacheError, load_plain_array

    good = tmp_path / "good.npy"
    numpy.save(good, numpy.arange(5, dtype=numpy.int32))
    assert load_plain_array(good, mmap_mode="r", allow_pickle=True).tolist() == [0, 1, 2, 3, 4]
    for name, value in (("text.npy", numpy.array(["a"])), ("fields.npy", numpy.zeros(2, dtype="i4,f4"))):
        numpy.save(tmp_path / name, value)
        with pytest.raises(IndexCacheError, match=name):
            load_plain_array(tmp_path / name, mmap_mode="r")
    numpy.savez(tmp_path / "archive.npz", a=numpy.arange(3))
    with pytest.raises(IndexCacheError, match="NpzFile"):
        load_plain_array(tmp_path / "archive.npz")
