"""Per-group caches live with their group: an entry goes when its group is collected, so a group built after
another was destroyed (which may get the dead one's `id`) starts empty instead of being served the dead
group's layout or scale-sharing answer."""
from __future__ import annotations

import gc
import os

import pytest
import torch.distributed as dist

from fp8_parallel.group_state import PerGroup
from launcher import _free_port


@pytest.fixture(scope="module")
def world():
    if dist.is_initialized():
        yield
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_entries_die_with_their_group_and_a_new_group_starts_empty(world):
    cache: PerGroup[int] = PerGroup()
    first = dist.new_group([0])
    cache.set(first, "layout", 7)
    cache.set(None, "layout", 3)  # the default group: held strongly
    assert cache.get(first, "layout") == 7 and cache.groups() == 2
    dist.destroy_process_group(first)
    del first
    gc.collect()
    assert cache.groups() == 1
    for _ in range(20):  # new groups, some of which may reuse the dead one's id: none sees its entry
        group = dist.new_group([0])
        assert cache.get(group, "layout") is None
        assert cache.get_or_compute(group, "layout", lambda: 11) == 11
        dist.destroy_process_group(group)
        del group
        gc.collect()
    assert cache.get(None, "layout") == 3 and cache.groups() == 1


def test_scale_sharing_answer_is_per_live_group(world):
    from fp8_parallel.testing import scale_sharing_groups, scales_shared_over

    scope_group, sp_group = dist.new_group([0]), dist.new_group([0])
    assert scales_shared_over(scope_group, sp_group) is True
    assert scales_shared_over(None, sp_group) is False
    dist.destroy_process_group(scope_group)
    dist.destroy_process_group(sp_group)
    del scope_group, sp_group
    gc.collect()
    assert scale_sharing_groups() == 0  # both destroyed: nothing of them is left
