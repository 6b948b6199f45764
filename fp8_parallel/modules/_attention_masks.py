"""Position masks of core attention (causal, sliding window), shared by the megatron-signature
`SDPADotProductAttention` and the TransformerEngine-signature `DotProductAttention`. Pure torch: importing
this module imports no megatron-core."""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def position_mask(
    q_start: int, q_len: int, k_len: int, causal: bool, window: Optional[Tuple[int, int]], device: torch.device
) -> Optional[torch.Tensor]:
    """Which keys each query may attend to (True = attend), `[q_len, k_len]`, or None when all of them.

    Queries sit at absolute positions `q_start ... q_start + q_len - 1`, keys at `0 ... k_len - 1`. `causal`
    hides later keys; `window = (left, right)` keeps keys within `left` before and `right` after the query
    (a negative bound is unbounded), as megatron's sliding-window mask does.
    """
    last = q_start + q_len - 1
    causal_needed = causal and q_start < k_len - 1
    window_needed = window is not None and (
        (window[0] >= 0 and last - window[0] > 0) or (window[1] >= 0 and q_start + window[1] < k_len - 1)
    )
    if not (causal_needed or window_needed):
        return None
    q = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(1)
    k = torch.arange(k_len, device=device).unsqueeze(0)
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= k <= q
    if window is not None:
        if window[0] >= 0:
            allowed &= k >= q - window[0]
        if window[1] >= 0:
            allowed &= k <= q + window[1]
    return allowed


def shifted_window_mask(
    offsets: torch.Tensor, q_len: int, k_len: int, window: Tuple[int, int]
) -> torch.Tensor:
    """`position_mask` with one query offset per batch element: `[b, 1, q_len, k_len]`, True = attend.

    Query `i` of batch element `n` sits at position `i + offsets[n]`; `window = (left, right)` keeps keys
    within `left` before and `right` after it (a negative bound is unbounded)."""
    q = torch.arange(q_len, device=offsets.device).view(1, q_len, 1) + offsets.view(-1, 1, 1)
    k = torch.arange(k_len, device=offsets.device).view(1, 1, k_len)
    allowed = torch.ones(offsets.numel(), q_len, k_len, dtype=torch.bool, device=offsets.device)
    if window[0] >= 0:
        allowed &= k >= q - window[0]
    if window[1] >= 0:
        allowed &= k <= q + window[1]
    return allowed.unsqueeze(1)
