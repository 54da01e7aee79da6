"""A CUDA rank and a CPU rank in one job, the batch cut by what each measured it can do.

Rank 0 trains on ``cuda:0`` and rank 1 on the CPU; one gloo process group joins them
(``cpu:gloo,cuda:gloo``) and every collective of the compiled programs is staged through two
bounded, reused host buffers (torch_hca/runtime/staging.py). Each rank's speed is measured on
the ranks (`hca.Deployment.measure`), the batch is cut by it, and two SGD steps are checked
against one device. It prints the rows each rank got, the step against the CUDA rank training
the whole batch alone, and the staging bandwidth (docs/heterogeneous.md).

    torchrun --nproc-per-node 2 examples/mixed_devices.py          # needs one CUDA device
    python examples/mixed_devices.py                               # no CUDA: two CPU ranks, staging forced on

Without CUDA both ranks are CPUs and staging is forced on (option ``staging="on"``): the same
path, copies host to host.
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_hca as hca
from torch_hca.runtime import staging

BATCH, WIDTH, STEPS = 48, 256, 2


def main():
    devices = ["cuda:0", "cpu"] if torch.cuda.is_available() else ["cpu", "cpu"]
    mesh = hca.init_mesh(devices=devices)
    rank, me = dist.get_rank(), torch.device(devices[dist.get_rank()])
    torch.manual_seed(0)
    one_device = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
    rows = hca.Deployment.measure().shares(BATCH)  # e.g. (40, 8): the CUDA rank does more
    cut = hca.Shard(0, shares=rows)
    model = hca.sharded({}, mesh=mesh, inputs=cut, outputs=cut, loss_reduction="mean")(copy.deepcopy(one_device).to(me))
    options = {"staging": "auto" if len(set(torch.device(d).type for d in devices)) > 1 else "on"}
    compiled = torch.compile(model, backend="hca", options=options)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, one_device))
    start = sum(rows[:rank])
    steps = []
    for _ in range(STEPS):
        x, target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)  # the same on every rank
        t0 = time.perf_counter()
        mine = slice(start, start + rows[rank])
        F.mse_loss(compiled(x[mine].to(me)), target[mine].to(me)).backward()
        opt.step()
        opt.zero_grad()
        steps.append(time.perf_counter() - t0)
        F.mse_loss(one_device(x), target).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    worst = max(
        ((p.full_tensor().cpu() - q).norm() / q.norm()).item()
        for p, q in zip(model.parameters(), one_device.parameters())
    )
    alone = copy.deepcopy(one_device).to(me)
    t0 = time.perf_counter()
    F.mse_loss(alone(x.to(me)), target.to(me)).backward()
    alone_s = time.perf_counter() - t0
    st = staging.stats()
    moved = st.bytes_to_host + st.bytes_from_host
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (str(me), steps[-1], alone_s, moved, st.seconds))
    if rank == 0:
        for r, (device, step_s, alone_s, moved, staged_s) in enumerate(every):
            print(
                f"rank {r} {device}: {rows[r]} of {BATCH} rows, step {step_s * 1e3:.1f} ms, "
                f"whole batch alone {alone_s * 1e3:.1f} ms, staged {moved} bytes at "
                f"{moved / max(staged_s, 1e-9) / 1e9:.2f} GB/s"
            )
        print(f"parameters after {STEPS} steps, max relative error against one device: {worst:.1e}")
        print("PASS" if worst < 1e-5 else "FAIL")


if __name__ == "__main__":
    hca.run(main, 2)  # under torchrun: this rank; else 2 local gloo ranks
