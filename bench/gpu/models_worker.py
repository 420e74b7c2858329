"""One process of bench/gpu/models_torch.py: a real model's training step or inference call, in a loop,
counted over a window that every process of a case shares.

    python3 bench/gpu/models_worker.py WORKLOAD [--stand-in] [--pause-ms MS]

WORKLOAD is one of WORKLOADS (random weights, weights=None: nothing is downloaded). The worker builds
its model on the first visible GPU, runs WARMUP_ITERS steps, prints {"ready": true, ...} and keeps
stepping: a process that stopped after its warm-up would leave the GPU to the others while they warm
up, and the case would not be in its steady state when the window opens. It then reads one JSON line on
stdin, {"start": T0, "end": T1} (CLOCK_MONOTONIC, which every process of the host shares), counts the
steps that end in [T0, T1), prints {"result": true, "iters": N, "rate": N / (T1 - T0), ...} after its
first step past T1, and exits. Every step ends with a synchronisation (a training loop's loss.item(), a
server returning its answer): the count is of work the GPU finished, not work queued.

--pause-ms MS makes it a service answering requests (bench/gpu/priority_latency.py): it sleeps MS
between steps, and its result line also has each step's latency in the window, "p50_ms", "p99_ms",
"max_ms" and "requests" (a step here is one request: from its first launch to its answer's sync).

--stand-in runs the simulated GPU's kernels instead of torch (ctypes on libcuda.so.1, through the gate
when it is preloaded), with the same protocol: tests/test_models_torch_standin.py checks the bench's
orchestration with it on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

# Steps run before "ready": the first ones allocate, pick kernels and fill the caching allocator.
WARMUP_ITERS = {"cnn-train": 8, "transformer-train": 8, "cnn-infer": 50, "transformer-infer": 50, "decoder-infer": 3}
WORKLOADS = tuple(WARMUP_ITERS)

# The transformer of both transformer workloads: a GPT-style stack of pre-norm encoder layers with a
# causal mask, an embedding and an output head.
VOCAB, D_MODEL, HEADS, LAYERS = 32000, 1024, 16, 6

# --stand-in: (kernel nanoseconds, kernels per step) on the simulated GPU. Long kernels for training,
# short ones for batch-1 inference, as on the GPU.
STAND_IN = {"cnn-train": (2_000_000, 4), "transformer-train": (1_000_000, 6),
            "cnn-infer": (50_000, 12), "transformer-infer": (50_000, 8), "decoder-infer": (30_000, 64)}
# decoder-infer: a Hugging Face GPT-2-shaped model (GPT2LMHeadModel(GPT2Config()), random weights)
# generating this many tokens, greedily, at batch 1, per request.
DECODER_TOKENS = 64


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def torch_step(workload: str) -> tuple[Callable[[], None], dict[str, str]]:
    """The workload's step (ending in a synchronisation) and what to say of the software."""
    import torch
    import torch.nn.functional as F
    import torchvision

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the work is on the GPU; 8 processes x all cores of OpenMP threads is noise
    # cudnn.benchmark stays off: it times candidate kernels during the first steps, and a process held
    # by the scheduler during that timing would pick other kernels than alone, so a case's process and
    # its solo could run different code.
    dev = torch.device("cuda")
    about = {"torch": torch.__version__, "torchvision": torchvision.__version__,
             "cuda": str(torch.version.cuda), "device": torch.cuda.get_device_name(dev)}

    if workload == "decoder-infer":
        import transformers

        about["transformers"] = transformers.__version__
        decoder = transformers.GPT2LMHeadModel(transformers.GPT2Config()).to(dev).eval()
        prompt = torch.randint(0, decoder.config.vocab_size, (1, 8), device=dev)
        mask = torch.ones_like(prompt)

        def decode() -> None:
            # min_new_tokens: random weights may pick the end-of-text token early.
            with torch.inference_mode():
                decoder.generate(prompt, attention_mask=mask, max_new_tokens=DECODER_TOKENS,
                                 min_new_tokens=DECODER_TOKENS, do_sample=False,
                                 pad_token_id=decoder.config.eos_token_id)
            torch.cuda.synchronize()

        return decode, about

    if workload in ("cnn-train", "cnn-infer"):
        train = workload == "cnn-train"
        model = (torchvision.models.resnet50 if train else torchvision.models.resnet18)(weights=None).to(dev)
        batch = 64 if train else 1
        x = torch.randn(batch, 3, 224, 224, device=dev)
        if train:
            y = torch.randint(0, 1000, (batch,), device=dev)
            sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

            def cnn_train() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                sgd.zero_grad(set_to_none=True)
                loss.backward()
                sgd.step()
                torch.cuda.synchronize()

            return cnn_train, about
        model.eval()

        def cnn_infer() -> None:
            with torch.inference_mode():
                model(x)
            torch.cuda.synchronize()

        return cnn_infer, about

    class Gpt(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
            layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.1, activation="gelu",
                                                     batch_first=True, norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = torch.nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
            # is_causal with the mask: attention takes the causal kernel instead of reading the mask.
            return self.head(self.blocks(self.embed(tokens), mask=causal, is_causal=True))

    gpt = Gpt().to(dev)
    train = workload == "transformer-train"
    batch, seq = (8, 512) if train else (1, 128)
    tokens = torch.randint(0, VOCAB, (batch, seq), device=dev)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=dev)
    if train:
        targets = torch.randint(0, VOCAB, (batch * seq,), device=dev)
        adamw = torch.optim.AdamW(gpt.parameters(), lr=3e-4)

        def transformer_train() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(gpt(tokens, causal).view(-1, VOCAB), targets)
            adamw.zero_grad(set_to_none=True)
            loss.backward()
            adamw.step()
            torch.cuda.synchronize()

        return transformer_train, about
    gpt.eval()

    def transformer_infer() -> None:
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            gpt(tokens, causal)
        torch.cuda.synchronize()

    return transformer_infer, about


def stand_in_step(workload: str) -> tuple[Callable[[], None], dict[str, str]]:
    """The simulated GPU's launch loop: a step is `count` kernels of `ns` nanoseconds, then
    cuCtxSynchronize (entry points as tests/cuda_driver_client.py calls them)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    ctx, module, func = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    r = cuda.cuInit(0) or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) or cuda.cuCtxSetCurrent(ctx)
    r = r or cuda.cuModuleLoadData(ctypes.byref(module), b"simgpu")
    r = r or cuda.cuModuleGetFunction(ctypes.byref(func), module, b"spin")
    if r:
        raise SystemExit(f"the simulated libcuda failed to start (CUresult {r}): is LD_LIBRARY_PATH set to "
                         "build/simgpu?")
    ns, count = STAND_IN[workload]
    kernel_ns = ctypes.c_uint64(ns)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(kernel_ns), ctypes.c_void_p))

    def step() -> None:
        for _ in range(count):
            if cuda.cuLaunchKernel(func, 1, 1, 1, 1, 1, 1, 0, None, params, None):
                raise SystemExit("cuLaunchKernel failed")
        if cuda.cuCtxSynchronize():
            raise SystemExit("cuCtxSynchronize failed")

    return step, {"torch": "stand-in", "device": "simulated GPU"}


def read_window(window: list[tuple[float, float]]) -> None:
    """Wait for the window on stdin; an orchestrator that went away (stdin closed) ends the worker."""
    line = sys.stdin.readline()
    if not line:
        os._exit(3)
    obj = json.loads(line)
    window.append((float(obj["start"]), float(obj["end"])))


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0..1) of sorted values, nearest rank."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(argv: list[str]) -> int:
    usage = f"usage: models_worker.py {{{','.join(WORKLOADS)}}} [--stand-in] [--pause-ms MS]"
    if not argv or argv[0] not in WORKLOADS:
        print(usage, file=sys.stderr)
        return 2
    workload = argv[0]
    pause = 0.0
    if "--pause-ms" in argv[1:]:
        try:
            pause = float(argv[argv.index("--pause-ms") + 1]) / 1e3
        except (IndexError, ValueError):
            print(usage, file=sys.stderr)
            return 2
    step, about = (stand_in_step if "--stand-in" in argv[1:] else torch_step)(workload)
    for _ in range(WARMUP_ITERS[workload]):
        step()
    emit(ready=True, pid=os.getpid(), workload=workload, **about)
    window: list[tuple[float, float]] = []
    threading.Thread(target=read_window, args=(window,), daemon=True).start()
    while not window:
        step()
        time.sleep(pause)
    start, end = window[0]
    iters = 0
    latencies: list[float] = []
    while True:
        began = time.monotonic()
        step()
        now = time.monotonic()
        if now >= end:
            break
        if now >= start:
            iters += 1
            if pause:
                latencies.append(now - began)
                time.sleep(pause)
    latency = {}
    if latencies:
        latencies.sort()
        latency = {"requests": len(latencies), "p50_ms": 1e3 * percentile(latencies, 0.5),
                   "p99_ms": 1e3 * percentile(latencies, 0.99), "max_ms": 1e3 * latencies[-1]}
    emit(result=True, pid=os.getpid(), workload=workload, iters=iters, window_s=end - start,
         rate=iters / (end - start), **latency)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
