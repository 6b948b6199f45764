"""State that belongs to a process group and dies with it.

Caches about a group (which layout its ranks agreed on, whether its ranks share delayed scales) must not
outlive the group: keyed by `id(group)`, a group created after another was destroyed can get the dead one's
id and be served its entry. `PerGroup` keys by the group object through weak references, so an entry goes
when its group is garbage-collected and a new group always starts empty.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Generic, Hashable, Optional, TypeVar

import torch.distributed as dist

V = TypeVar("V")


class PerGroup(Generic[V]):
    """A mapping `(group, key) -> value` whose entries live as long as their group object (`None`, the
    default group, is held strongly)."""

    def __init__(self) -> None:
        self._by_group: "weakref.WeakKeyDictionary[dist.ProcessGroup, Dict[Hashable, V]]" = weakref.WeakKeyDictionary()
        self._default: Dict[Hashable, V] = {}

    def _entries(self, group: Optional[dist.ProcessGroup], create: bool) -> Optional[Dict[Hashable, V]]:
        if group is None:
            return self._default
        entries = self._by_group.get(group)
        if entries is None and create:
            entries = self._by_group[group] = {}
        return entries

    def get(self, group: Optional[dist.ProcessGroup], key: Hashable = None) -> Optional[V]:
        entries = self._entries(group, create=False)
        return None if entries is None else entries.get(key)

    def set(self, group: Optional[dist.ProcessGroup], key: Hashable, value: V) -> None:
        self._entries(group, create=True)[key] = value

    def get_or_compute(self, group: Optional[dist.ProcessGroup], key: Hashable, compute: Callable[[], V]) -> V:
        entries = self._entries(group, create=True)
        if key not in entries:
            entries[key] = compute()
        return entries[key]

    def groups(self) -> int:
        """How many live groups have entries (the default group counted when it has any)."""
        return len(self._by_group) + (1 if self._default else 0)
