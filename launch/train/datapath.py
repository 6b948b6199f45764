"""Checks of `--data-path` that need no megatron import (run on every rank before anything collective)."""
from __future__ import annotations

import os
from typing import Optional, Sequence


class DataError(ValueError):
    """Data flags that name no usable dataset."""


def dataset_exists(prefix: str) -> bool:
    """Whether `prefix` names a megatron indexed dataset (`PREFIX.bin` and `PREFIX.idx`)."""
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def check_data_path(data_path: Optional[Sequence[str]]) -> None:
    """Check `--data-path` on this rank's file system (call it on every rank before any collective).

    Raises:
        DataError: a prefix without its `.bin` / `.idx` files, or a weight without a prefix.
    """
    if not data_path:
        return
    prefixes = [p for p in data_path if not _is_number(p)]
    if not prefixes or (len(prefixes) != len(data_path) and 2 * len(prefixes) != len(data_path)):
        raise DataError(f"--data-path {' '.join(data_path)}: expected PREFIX ... or WEIGHT PREFIX WEIGHT PREFIX ...")
    missing = [p for p in prefixes if not dataset_exists(p)]
    if missing:
        raise DataError(f"--data-path: no megatron indexed dataset at {', '.join(missing)} (expected PREFIX.bin "
                        "and PREFIX.idx; make one with launch/preprocess_data.py)")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
