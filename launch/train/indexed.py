"""Write documents of token ids as a megatron-core indexed dataset (`PREFIX.bin` + `PREFIX.idx`), atomically."""
from __future__ import annotations

import os
from typing import Iterable, List

import torch

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def write_indexed_dataset(prefix: str, documents: Iterable[List[int]], dtype, eod: int) -> int:
    """Write `documents` (each followed by `eod`) under `prefix`; returns the number of documents.

    The files are written under temporary names and renamed at the end (`.bin` first, then `.idx`), so a
    reader that finds `PREFIX.idx` finds a complete dataset.

    Raises:
        ValueError: no documents.
    """
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    count = 0
    for ids in documents:
        if not ids:
            continue
        builder.add_document(torch.tensor(list(ids) + [eod], dtype=torch.int64), [len(ids) + 1])
        count += 1
    builder.finalize(tmp + ".idx")
    if count == 0:
        for ext in (".bin", ".idx"):
            os.remove(tmp + ext)
        raise ValueError(f"no non-empty documents to write to {prefix}")
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    return count
