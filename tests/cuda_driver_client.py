"""A libcuda client driven line by line on stdin, for the eBPF tests: it calls the driver's exported
entry points through ctypes (as the CUDA runtime does, no gate), and answers one JSON line per command.

Commands: `init [DEVICE]`, `alloc SIZE` (cuMemAlloc_v2), `pitch WIDTH HEIGHT` (cuMemAllocPitch_v2),
`managed SIZE`, `async SIZE`, `create SIZE` (cuMemCreate), `free` (the last pointer), `release` (the
last handle), `launch NS COUNT` (cuLaunchKernel of NS-nanosecond kernels, then cuCtxSynchronize),
`exec PROGRAM [ARG...]` (answers, then becomes PROGRAM: the same pid, the driver's files closed), `exit`.
Ready line: {"pid": ...}.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

cuda = ctypes.CDLL(os.environ.get("GT_LIBCUDA", "libcuda.so.1"))
u64 = ctypes.c_uint64


class AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("gpu_direct", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    pointers: list[int] = []
    handles: list[int] = []
    device = 0
    func = ctypes.c_void_p()
    emit(pid=os.getpid())
    for line in sys.stdin:
        cmd, *args = line.split()
        r = 0
        if cmd == "init":
            device = int(args[0]) if args else 0
            ctx = ctypes.c_void_p()
            r = cuda.cuInit(0) or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device)
            r = r or cuda.cuCtxSetCurrent(ctx)
            module, func = ctypes.c_void_p(), ctypes.c_void_p()
            r = r or cuda.cuModuleLoadData(ctypes.byref(module), b"simgpu")
            r = r or cuda.cuModuleGetFunction(ctypes.byref(func), module, b"spin")
        elif cmd in ("alloc", "managed", "async"):
            p = u64()
            size = u64(int(args[0]))
            if cmd == "alloc":
                r = cuda.cuMemAlloc_v2(ctypes.byref(p), size)
            elif cmd == "managed":
                r = cuda.cuMemAllocManaged(ctypes.byref(p), size, 1)
            else:
                r = cuda.cuMemAllocAsync(ctypes.byref(p), size, None)
            if r == 0:
                pointers.append(p.value)
        elif cmd == "pitch":
            p, pitch = u64(), ctypes.c_size_t()
            r = cuda.cuMemAllocPitch_v2(ctypes.byref(p), ctypes.byref(pitch), ctypes.c_size_t(int(args[0])),
                                        ctypes.c_size_t(int(args[1])), 4)
            if r == 0:
                pointers.append(p.value)
            emit(cmd=cmd, result=r, pitch=pitch.value)
            continue
        elif cmd == "create":
            h = u64()
            prop = AllocationProp(type=1, loc_type=1, loc_id=device)
            r = cuda.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(int(args[0])), ctypes.byref(prop), u64(0))
            if r == 0:
                handles.append(h.value)
        elif cmd == "free":
            r = cuda.cuMemFree_v2(u64(pointers.pop()))
        elif cmd == "release":
            r = cuda.cuMemRelease(u64(handles.pop()))
        elif cmd == "launch":
            ns, count = u64(int(args[0])), int(args[1])
            params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(ns), ctypes.c_void_p))
            for _ in range(count):
                r = cuda.cuLaunchKernel(func, 1, 1, 1, 1, 1, 1, 0, None, params, None)
                if r:
                    break
            r = r or cuda.cuCtxSynchronize()
        elif cmd == "exec":
            emit(cmd=cmd, result=0)
            os.execvp(args[0], args)
        elif cmd == "exit":
            emit(cmd=cmd, result=0)
            return
        emit(cmd=cmd, result=r)


if __name__ == "__main__":
    main()
