"""Where the host time of a tiny FP8 Linear step goes (cProfile), to guide host-overhead work."""
import cProfile
import pstats

import torch

import fp8_parallel as fp

x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
ours = fp.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
recipe = fp.DelayedScaling(amax_history_len=16)


def step():
    with fp.autocast(recipe=recipe):
        y = ours(x)
    y.sum().backward()


for _ in range(50):
    step()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(300):
    step()
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
