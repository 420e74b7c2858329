"""One job of bench/gpu/gang_ddp.py and bench/gpu/gang_serve.py. Training: ResNet-50 (bf16 autocast,
batch 64 a GPU, SGD, random weights), either data-parallel over the GPUs torchrun gives it (--ddp: one
rank a GPU, NCCL, gradients all-reduced every step) or alone on the first visible GPU. Or, with --serve
(under torchrun), a tensor-parallel service: see serve() below.

    BENCH_WINDOW=T0,T1 python3 bench/gpu/ddp_worker.py [--ddp | --serve] [--pause-ms MS]

(The window comes in the environment: torchrun would take --start for its own --start-method.) It
steps until T1 (CLOCK_MONOTONIC, which every process of the host shares), counts the steps that end
in [T0, T1) (each ends with loss.item(): the GPU finished it), and prints one JSON line {"result": true,
"steps": N, "rate": N / (T1 - T0), "steps_before": the steps that ended before T0 (its warm-up), ...}: under
--ddp only rank 0 prints (every rank takes the same steps).
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
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--pause-ms", type=float, default=None,
                        help="between an answer and the next request (--serve: 30 by default), or the CPU work "
                             "after each training step (a data loader it waits for: 0 by default)")
    args = parser.parse_args()
    args.start, args.end = (float(t) for t in os.environ["BENCH_WINDOW"].split(","))
    if args.serve:
        args.pause_ms = 30.0 if args.pause_ms is None else args.pause_ms
        return serve(args)
    pause = (args.pause_ms or 0.0) / 1000

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

    steps = before = 0
    ends: list[float] = []
    over = torch.zeros(1, device=device)
    while True:
        step()
        if pause:
            time.sleep(pause)
        now = time.monotonic()
        ends.append(now)
        if args.start <= now < args.end:
            steps += 1
        before += now < args.start
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
                          "steps_before": before, "ddp": args.ddp, "torch": torch.__version__,
                          "cuda": str(torch.version.cuda), "device": torch.cuda.get_device_name(device)}), flush=True)
    if os.environ.get("BENCH_STEP_TIMES"):
        with open(f"{os.environ['BENCH_STEP_TIMES']}.{rank}.{os.getpid()}", "w") as out:
            out.writelines(f"{t:.6f}\n" for t in ends)
    if args.ddp:
        torch.distributed.destroy_process_group()
    return 0


# The service's shape: a decoder's MLP blocks split over the ranks as Megatron splits them (the first
# matmul by columns, the second by rows, an all-reduce of the activations after each block), batch 8,
# TOKENS forward passes a request. About 4 GB of bf16 weights a rank: memory-bound, a few ms a request
# on an H100, one small NCCL all-reduce a layer.
HIDDEN, FFN, LAYERS, BATCH, TOKENS = 4096, 16384, 24, 8, 8


def serve(args: argparse.Namespace) -> int:
    """Requests one after another, `--pause-ms` after each answer; rank 0 receives them and tells the
    others over a CPU (gloo) group, as a serving engine's driver rank does, so that no rank waits for a
    request inside a GPU kernel. A request's latency is from rank 0 taking it to its answer on rank 0
    (the GPUs finished). Prints {"result": true, "requests": N, "rate", "p50_ms", "p99_ms", "max_ms"}
    over the requests taken in the window."""
    import statistics

    import torch
    import torch.distributed as dist

    rank, ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    control = dist.new_group(backend="gloo")
    torch.manual_seed(rank)
    shard = FFN // ranks
    up = [torch.randn(HIDDEN, shard, device=device, dtype=torch.bfloat16) * 0.01 for _ in range(LAYERS)]
    down = [torch.randn(shard, HIDDEN, device=device, dtype=torch.bfloat16) * 0.01 for _ in range(LAYERS)]
    x0 = torch.randn(BATCH, HIDDEN, device=device, dtype=torch.bfloat16)
    word = torch.zeros(1, dtype=torch.int64)  # on the CPU: 1 a request, 0 the end

    def answer() -> None:
        x = x0
        for _ in range(TOKENS):
            for w1, w2 in zip(up, down, strict=True):
                y = torch.relu(x @ w1) @ w2
                dist.all_reduce(y)
                x = x + y
        torch.cuda.synchronize()

    latencies: list[float] = []
    while True:
        if rank == 0:
            time.sleep(args.pause_ms / 1000)
            began = time.monotonic()
            word.fill_(1 if began < args.end else 0)
        dist.broadcast(word, src=0, group=control)
        if not word.item():
            break
        answer()
        if rank == 0 and args.start <= began:
            latencies.append(time.monotonic() - began)
    if rank == 0:
        ms = sorted(t * 1000 for t in latencies)
        print(json.dumps({"result": True, "requests": len(ms), "rate": len(ms) / (args.end - args.start),
                          "p50_ms": statistics.median(ms) if ms else float("nan"),
                          "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan"),
                          "max_ms": ms[-1] if ms else float("nan"), "torch": torch.__version__,
                          "cuda": str(torch.version.cuda), "device": torch.cuda.get_device_name(device)}),
              flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
