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
    """The index of an mgpu device given as None, an int, a string or a
    torch.device; out of range raises torch.AcceleratorError, as on CUDA."""
    if device is None:
        return 0
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "mgpu":
            raise ValueError(f"Expected an mgpu device, but got: {device}")
        index = 0 if device.index is None else device.index
    _C.check_device_index(index)
    return max(index, 0)


def synchronize(device=None) -> None:
    """Runs every pending op and raises the first error an op raised."""
    _device_index(device)
    _C.synchronize()


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    """On CPU lanes False: unlike CUDA, mgpu works in a forked child. The
    child's lane threads did not survive the fork, so its plans run on one
    lane (the calling thread); torch.manual_seed seeds mgpu there, as
    everywhere (it skips a device whose module reports a bad fork). On a
    GPU's streams mgpu is CUDA: a bad fork where CUDA's is one."""
    if not any(lane.split("/")[0].startswith("cuda") for lane in _C.lanes()):
        return False
    return bool(torch.cuda._is_in_bad_fork())


def _in_forked_child_with_lanes() -> bool:
    """Whether this is a forked child of a process that had started lane or
    background threads (it plans on one lane)."""
    return _C.in_forked_child_with_lanes()


# Device description


def devices_of(lane_names) -> list:
    """The devices lanes are on, in order: ['cpu:0/lane0', 'cpu:1/lane0']
    -> ['cpu:0', 'cpu:1']."""
    devices = []
    for lane in lane_names:
        dev = lane.split("/")[0]
        if dev not in devices:
            devices.append(dev)
    return devices


class _MgpuDeviceProperties:
    """What torch.mgpu.get_device_properties() returns: the lanes the mgpu
    device plans over and the memory its values live in."""

    def __init__(self, index: int):
        lanes = list(_C.lanes())
        devices = devices_of(lanes)
        self.index = index
        self.lanes = lanes
        self.devices = devices
        self.multi_processor_count = len(lanes)
        self.total_memory = torch.accelerator.get_memory_info(index)[1]
        self.type = "mgpu"
        self.name = f"mgpu ({len(lanes)} lanes on {', '.join(devices)})"

    def __repr__(self):
        return (f"_MgpuDeviceProperties(name='{self.name}', total_memory={self.total_memory // (1024 * 1024)}MB, "
                f"multi_processor_count={self.multi_processor_count}, devices={self.devices})")


def get_device_properties(device=None) -> _MgpuDeviceProperties:
    if isinstance(device, int) and not 0 <= device < device_count():
        raise AssertionError("Invalid device id")  # what torch.cuda raises
    return _MgpuDeviceProperties(_device_index(device))


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def get_device_capability(device=None):
    """On CUDA lanes, the lowest (major, minor) among their GPUs: what code
    for mgpu may assume of every device it runs on. On CPU lanes (0, 0)."""
    props = get_device_properties(device)
    gpus = [d for d in props.devices if d.startswith("cuda")]
    if not gpus:
        return (0, 0)
    return min(tuple(torch.cuda.get_device_capability(d)) for d in gpus)


# Memory: what mgpu values hold (host bytes on CPU lanes, device bytes on
# stream lanes), through PyTorch's accelerator memory API.


def memory_allocated(device=None) -> int:
    return torch.accelerator.memory_allocated(_device_index(device))


def max_memory_allocated(device=None) -> int:
    return torch.accelerator.max_memory_allocated(_device_index(device))


def memory_reserved(device=None) -> int:
    return torch.accelerator.memory_reserved(_device_index(device))


def max_memory_reserved(device=None) -> int:
    return torch.accelerator.max_memory_reserved(_device_index(device))


def memory_stats(device=None):
    return torch.accelerator.memory_stats(_device_index(device))


def reset_peak_memory_stats(device=None) -> None:
    torch.accelerator.reset_peak_memory_stats(_device_index(device))


def reset_accumulated_memory_stats(device=None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_device_index(device))


def mem_get_info(device=None):
    """(free, total) bytes of the memory mgpu values live in."""
    return torch.accelerator.get_memory_info(_device_index(device))


def empty_cache() -> None:
    """Releases the blocks the lanes keep for reuse (no value is lost)."""
    _C.empty_cache()


# Streams and events. mgpu orders work by its data: a stream is a name that
# code written for CUDA streams can use (its own id, a current stream per
# thread), and results never depend on it; waiting on a stream or an event
# runs what is pending. An event marks every op recorded before it; its time
# is when the last of them finished on its lane.


class Stream(torch.Stream):
    """An mgpu stream (torch.cuda.Stream's counterpart)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        index = _device_index(device)
        return super().__new__(cls, device=torch.device("mgpu", index), priority=priority, **kwargs)


class _EventType(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.Event) and obj.device is not None and obj.device.type == "mgpu"


class Event(metaclass=_EventType):
    """An mgpu event (torch.cuda.Event's counterpart). It is a torch.Event on
    the mgpu device (PyTorch's Event methods take exactly torch.Event as
    their argument, so it is not a subclass); isinstance(e, torch.mgpu.Event)
    holds for every mgpu event."""

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        return torch.Event(device="mgpu", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def current_stream(device=None) -> torch.Stream:
    return torch.accelerator.current_stream(_device_index(device))


def default_stream(device=None) -> torch.Stream:
    index = _device_index(device)
    current = torch.accelerator.current_stream(index)
    return torch.Stream(stream_id=0, device_index=index, device_type=current.device_type)


def set_stream(stream) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes `stream` current for the block (None: no change)."""

    def __init__(self, stream):
        self.stream = stream
        self.previous = None

    def __enter__(self):
        if self.stream is not None:
            self.previous = torch.accelerator.current_stream(self.stream.device_index)
            torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *args):
        if self.previous is not None:
            torch.accelerator.set_stream(self.previous)
        return False


def stream(stream) -> StreamContext:
    return StreamContext(stream)


def seed() -> None:
    """Seeds mgpu's generator with a non-deterministic number."""
    default_generator().seed()


def seed_all() -> None:
    default_generator().seed()


def get_rng_state_all():
    return [get_rng_state()]


def set_rng_state_all(new_states) -> None:
    for state in new_states:
        set_rng_state(state)


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
