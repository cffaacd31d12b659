"""A worker rank: runs the nodes that rank 0 (the controller) plans onto its
lane, until the controller releases it or goes away.

    python -m torch_mgpu.worker        # under torchrun, or with RANK, WORLD_SIZE,
                                       # MASTER_ADDR and MASTER_PORT set

It executes only ATen operators named in the controller's messages, over
bytes the controller sent; nothing it receives is run as Python.
"""
import os
import sys

import torch
import torch.distributed as dist

import torch_mgpu


def serve() -> bool:
    """Joins the default process group (env://) if not joined yet and serves
    rank 0; True when released, False when rank 0 went away."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        raise RuntimeError("torch_mgpu.worker: rank 0 is the controller (the user's program), not a worker")
    threads = torch_mgpu._C._env_text("TORCH_MGPU_WORKER_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    return torch_mgpu._C._serve(dist.group.WORLD)


def main() -> int:
    released = serve()
    # The controller may be gone: leave without the group's collective teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if released else 1)


if __name__ == "__main__":
    main()
