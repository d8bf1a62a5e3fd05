"""torch's abort at exit under FSDP1 on gloo (pytorch#190489), with neither Lightning nor tierckpt.

Two CPU ranks train an FSDP1 model a few steps, take its full state dict (an all-gather), and exit.
About 1 run in 3 aborts as the interpreter shuts down ("terminate called without an active
exception", SIGABRT): a gloo worker thread frees the all-gather's tensors, which needs the interpreter
lock, after finalization began. ``DESTROY=1`` calls ``destroy_process_group()`` first and ``BARRIER=1``
a final ``barrier()``: neither prevents it (docs/integrations.md gives the counts). ``END_JOB=1`` drops
the model and calls ``tierckpt.testing.ranks.end_job()``, which leaves no gloo thread to race the exit.

    for i in $(seq 12); do .venv/bin/torchrun --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port $((29600 + i)) scripts/fsdp1_gloo_exit_abort.py > /dev/null 2>&1 || echo aborted; done
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 1)), device_id=torch.device("cpu"))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
for _ in range(4):
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
weights = {k: v.tolist() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
if os.environ.get("BARRIER"):
    dist.barrier()
if os.environ.get("DESTROY"):
    dist.destroy_process_group()
if os.environ.get("END_JOB"):
    from tierckpt.testing.ranks import end_job

    del model, optimizer
    end_job()
