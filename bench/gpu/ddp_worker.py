"""One training job of bench/gpu/gang_ddp.py: ResNet-50 (bf16 autocast, batch 64 a GPU, SGD, random
weights), either data-parallel over the GPUs torchrun gives it (--ddp: one rank a GPU, NCCL, gradients
all-reduced every step) or alone on the first visible GPU.

    BENCH_WINDOW=T0,T1 python3 bench/gpu/ddp_worker.py [--ddp]

(The window comes in the environment: torchrun would take --start for its own --start-method.) It
steps until T1 (CLOCK_MONOTONIC, which every process of the host shares), counts the steps that end
in [T0, T1) (each ends with loss.item(): the GPU finished it), and prints one JSON line {"result": true,
"steps": N, "rate": N / (T1 - T0), ...}: under --ddp only rank 0 prints (every rank takes the same steps).
With BENCH_STEP_TIMES=PATH each rank also writes the CLOCK_MONOTONIC end of each of its steps
(one per line, PATH.RANK.PID: several jobs may share PATH), to lay beside a scheduler's turns.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp", action="store_true")
    args = parser.parse_args()
    args.start, args.end = (float(t) for t in os.environ["BENCH_WINDOW"].split(","))

    import torch
    import torch.nn.functional as F
    import torchvision

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank = 0
    if args.ddp:
        import torch.distributed as dist

        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    device = torch.device("cuda", rank if args.ddp else 0)
    model: torch.nn.Module = torchvision.models.resnet50(weights=None).to(device).to(memory_format=torch.channels_last)
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (64,), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()

    steps = 0
    ends: list[float] = []
    over = torch.zeros(1, device=device)
    while True:
        step()
        now = time.monotonic()
        ends.append(now)
        if args.start <= now < args.end:
            steps += 1
        if not args.ddp:
            if now >= args.end:
                break
            continue
        # Every rank stops after the same step (one that stepped once more would wait in its all-reduce
        # for ever): rank 0's clock decides.
        over.fill_(1.0 if rank == 0 and now >= args.end else 0.0)
        torch.distributed.all_reduce(over)
        if over.item() > 0:
            break
    if rank == 0:
        print(json.dumps({"result": True, "steps": steps, "rate": steps / (args.end - args.start),
                          "ddp": args.ddp, "torch": torch.__version__, "cuda": str(torch.version.cuda),
                          "device": torch.cuda.get_device_name(device)}), flush=True)
    if os.environ.get("BENCH_STEP_TIMES"):
        with open(f"{os.environ['BENCH_STEP_TIMES']}.{rank}.{os.getpid()}", "w") as out:
            out.writelines(f"{t:.6f}\n" for t in ends)
    if args.ddp:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
