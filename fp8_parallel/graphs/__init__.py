"""Graphed FP8 callables: one forward and one backward CUDA graph per (callable, microbatch), FP8 state kept right.

`make_graphed_callables` captures each callable's forward and backward (torch's and TransformerEngine's
conventions; see its docstring). What FP8 needs on top of plain CUDA graphs:

* Amaxes. While recorded (warm-up, capture) a callable runs under a recording scope: its FP8 modules write
  their amaxes into the recording's own tables, and nothing is reduced. On replay the recorded amaxes are
  maxed into the caller's autocast scope (one kernel per scope key), so the scope's reduce-and-update runs
  when that scope ends, exactly as in eager mode; scopes opened inside the callable (an FP8 layer's own
  scope, an expert scope) are re-opened around the registration so they share or own keys as they would
  eagerly. The backward replay does the same for the grad amaxes and counts as the backward of those calls.
* Scales are read by the graphs from the modules' scale buffers, which updates write in place: an update
  between replays takes effect.
* Weight caching: captured weight casts write a persistent cache unless a device flag says "skip"; each
  replay sets the flag from `is_first_microbatch` (a weight changed in place since its last cast is cast
  again whatever the flag would say, so a cached FP8 weight is never used stale).
* Warm-up and capture leave amax histories and scales as they were (saved before, restored after).

* RNG: code that forks megatron's RNG tracker (dropout) is captured with the tracker's graph-safe states
  registered with every graph; a tracker without them is refused before capture, with the fix in the
  message. CUDA RNG states are restored after capture, so graphing does not move the random streams.
* Replay only where it reproduces the eager call (same training mode, grad enabled, the captured FP8 recipe
  and group, or FP8 off for callables captured without it); other calls run eagerly, an FP8 mismatch says
  so once per reason, and `replay_count` / `eager_count` count the calls.

TransformerEngine's keyword names are accepted (`_order` also gives its return layout: one callable per
chunk, microbatch and layer; a per-callable `fp8_enabled` tuple; `reset()` releases graphs); differences
are in `make_graphed_callables`'s docstring.

Without CUDA the same objects run the callables eagerly per call (same recording and registration path,
one warning), so CPU tests exercise the code that graphs use.
"""
from __future__ import annotations

from .capture import make_graphed_callables
from .graphed_callable import GraphedCallable, GraphedMicrobatch

__all__ = ["GraphedCallable", "GraphedMicrobatch", "make_graphed_callables"]
