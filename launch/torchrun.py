"""torchrun, ending a failed job with its error line instead of torchrun's traceback.

    python launch/torchrun.py --nproc_per_node=4 launch/pretrain_gpt.py [job flags]

takes torchrun's own arguments and runs the job exactly as `torchrun` does (the same launcher, rendezvous and
restarts). Only the end of a failed job differs. torchrun raises `ChildFailedError`, which prints a Python
traceback of torchrun itself and a failure table. Here the launcher prints one line instead, after the
failed rank's own output: which rank failed first and how. It then exits with that rank's exit status: 2 for
a usage error (whose one line rank 0 has printed), as the job itself does.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Tuple


def _failure_line(err) -> Tuple[str, int]:
    """The one line that ends a failed job, and the exit status to end with."""
    rank, failure = err.get_first_failure()
    status = failure.exitcode if failure.exitcode > 0 else 1
    head = f"torchrun: {err.name} failed on rank {rank}"
    if failure.exitcode < 0:
        return f"{head}: {failure.signal_name()}", status
    if failure.error_file_data.get("message"):  # the job's own one-line error, printed by that rank above
        return f"{head} (exit status {failure.exitcode}): the error above", status
    return f"{head} (exit status {failure.exitcode}): see that rank's output above", status


def main(argv: Optional[List[str]] = None) -> int:
    """Run torchrun with `argv` (default: this process's arguments); returns the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as err:
        line, status = _failure_line(err)
        print(line, file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
