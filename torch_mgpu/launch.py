"""Runs a program over every rank of a torchrun world:

    torchrun --nproc-per-node=N -m torch_mgpu.launch script.py [args...]

Rank 0 runs `script.py` unchanged, with mgpu's devices set to this process's
CPU lanes plus the CPU of every other rank ("rank1:cpu", ...); the other
ranks serve as workers (torch_mgpu.worker). When the script ends, the
workers are released.
"""
import os
import runpy
import sys

import torch.distributed as dist

import torch_mgpu
from torch_mgpu import worker


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: torchrun ... -m torch_mgpu.launch script.py [args...]")
    dist.init_process_group("gloo")
    if dist.get_rank() != 0:
        worker.main()
        return
    devices = ["cpu"] + [f"rank{r}:cpu" for r in range(1, dist.get_world_size())]
    code = 0
    try:
        torch_mgpu.configure(devices=devices)
        script = sys.argv[1]
        sys.argv = sys.argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch_mgpu.synchronize()
        torch_mgpu.release_workers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
