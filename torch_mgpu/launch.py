"""Runs a program over every rank of a torchrun world:

    torchrun --nproc-per-node=N -m torch_mgpu.launch script.py [args...]

Rank 0 runs `script.py` unchanged, with mgpu's devices set to this process's
CPU lanes plus the CPU of every other rank ("rank1:cpu", ...), or, where
every rank sees a GPU, each rank's own GPU (the one of its LOCAL_RANK:
"cuda:0", "rank1:cuda:1", ...); the other ranks serve as workers
(torch_mgpu.worker). When the script ends, the
workers are released.
"""
import os
import runpy
import sys

import torch.distributed as dist

import torch_mgpu
from torch_mgpu import worker


def _devices() -> list:
    """Every rank's device (a collective: every rank calls it): its own GPU
    where every rank has one, else the CPUs."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (local, gpus))
    if all(n > 0 for _, n in seen):
        return [f"{'' if r == 0 else f'rank{r}:'}cuda:{lr % n}" for r, (lr, n) in enumerate(seen)]
    return ["cpu"] + [f"rank{r}:cpu" for r in range(1, dist.get_world_size())]


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: torchrun ... -m torch_mgpu.launch script.py [args...]")
    dist.init_process_group("gloo")
    devices = _devices()
    if dist.get_rank() != 0:
        worker.main()
        return
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
