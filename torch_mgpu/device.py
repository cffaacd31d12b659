"""The `torch.mgpu` device module (torch.mgpu.device_count() and friends)."""
import torch

from . import _C


def is_available() -> bool:
    return True


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return 0


def set_device(device) -> None:
    _device_index(device)


class device:
    """Context manager that selects an mgpu device (as torch.cuda.device).
    mgpu has one device, so it checks the index and selects nothing."""

    def __init__(self, device):
        self.idx = _device_index(device)

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def _device_index(device) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "mgpu":
            raise ValueError(f"Expected an mgpu device, but got: {device}")
        index = 0 if device.index is None else device.index
    if not 0 <= index < device_count():
        raise IndexError(
            f"mgpu device index {index} is out of range: torch.mgpu.device_count() is {device_count()}"
        )
    return index


def synchronize(device=None) -> None:
    _C.synchronize()


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def manual_seed(seed: int) -> None:
    _C.manual_seed_all(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def manual_seed_all(seed: int) -> None:
    _C.manual_seed_all(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def default_generator(index: int = 0) -> torch.Generator:
    return _C.default_generator(index)


def get_rng_state(device="mgpu") -> torch.Tensor:
    return default_generator().get_state()


def set_rng_state(new_state: torch.Tensor, device="mgpu") -> None:
    default_generator().set_state(new_state)


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]


def _lazy_init() -> None:
    pass
