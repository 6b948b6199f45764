"""Starting torch.distributed so that a job restarted by torchrun (`--max-restarts`) can join again.

torchrun's workers reach each other through the agent's TCPStore, and every attempt of a restarted worker
group reuses that store (static rendezvous; c10d rendezvous unless TCPStore sharing is turned off) without
separating the attempts' keys. A restarted rank can then read the previous attempt's process-group keys (the
addresses of dead ranks) and fail to connect ("Connection refused"). The job therefore starts torch.distributed
on the agent's store with its keys prefixed by the attempt number.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=10)


def init_process_group(timeout: datetime.timedelta = TIMEOUT) -> bool:
    """Start torch.distributed on torchrun's agent store, keys prefixed by the restart attempt.

    Returns True when it started torch.distributed (the caller destroys it); False outside torchrun's agent
    store or when torch.distributed is already up (`parallel_state.initialize` then starts it as usual).
    """
    if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                                is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"fp8p/attempt{attempt}/", agent_store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True


def report_error_to_torchrun(text: str) -> None:
    """Hand torchrun the one-line error this rank exits with, so that its failure summary names it (its
    "traceback" field) instead of pointing to the elastic error docs. No-op outside torchrun."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass
