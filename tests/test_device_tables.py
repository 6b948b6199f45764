"""`fp8_parallel.device_tables`: host tables of ints as cached device tensors, also inside CUDA graph capture."""
import pytest
import torch

from fp8_parallel import device_tables
from fp8_parallel.device_tables import device_table


def test_one_tensor_per_content_and_the_oldest_evicted(monkeypatch):
    monkeypatch.setattr(device_tables, "EAGER_ENTRIES", 3)
    monkeypatch.setattr(device_tables, "_EAGER", type(device_tables._EAGER)())
    a = device_table([4, 9, 12], torch.int32, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.tolist() == [4, 9, 12]
    assert device_table((4, 9, 12), torch.int32, "cpu") is a  # same content: the same tensor
    assert device_table([4, 9, 12], torch.int64, "cpu") is not a  # the dtype is part of the key
    rows = device_table([[1, 2], [3, 4]], torch.int64, "cpu")
    assert rows.shape == (2, 2) and rows.tolist() == [[1, 2], [3, 4]]
    device_table([5], torch.int32, "cpu")  # a fourth entry: the oldest (a, used twice, then left) goes
    assert len(device_tables._EAGER) == 3
    assert device_table([4, 9, 12], torch.int32, "cpu") is not a


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_table_first_seen_in_capture_replays_its_values():
    ends = [3, 7, 7, 12]  # an empty block too
    x = torch.zeros(12, device="cuda")
    out = torch.empty(4, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            table = device_table(ends, torch.int64, x.device)  # pageable copies are refused here
            out.copy_(table * 2 + x[:4].long())
    assert device_table(ends, torch.int64, x.device) is table  # kept: the graph reads it
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == [6, 14, 14, 24]
