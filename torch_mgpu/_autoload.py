"""The `torch.backends` entry point: `import torch` imports torch_mgpu, which
registers the mgpu device (TORCH_DEVICE_BACKEND_AUTOLOAD=0: it does not).

A module of its own: when a program imports torch_mgpu first, torch's import
runs inside torch_mgpu's, and the package is still being initialized when
torch calls this; it finishes its registration once torch has loaded."""


def load() -> None:
    import torch_mgpu  # noqa: F401
