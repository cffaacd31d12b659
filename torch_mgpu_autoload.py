"""The `torch.backends` entry point: `import torch` imports torch_mgpu, which
registers the mgpu device (TORCH_DEVICE_BACKEND_AUTOLOAD=0: it does not).

A top-level module, outside the package: loading an entry point imports its
module's package first, and a package that fails to import would fail there,
before this could catch it. When a program imports torch_mgpu first, torch's
import runs inside torch_mgpu's, and the package is still being initialized
when torch calls this; it finishes its registration once torch has loaded.

A torch_mgpu that cannot load (a source checkout without its built library
shadowing the installed package, a build for another torch) must never stop
`import torch`: torch goes on without the mgpu device, with a warning that
says why and what to do. `import torch_mgpu` itself still raises."""


def load() -> None:
    try:
        import torch_mgpu  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure: torch must still import
        import os
        import warnings

        from importlib.util import find_spec

        try:
            spec = find_spec("torch_mgpu")
            where = os.path.dirname(spec.origin) if spec and spec.origin else "?"
        except Exception:  # noqa: BLE001
            where = "?"
        warnings.warn(
            f"torch_mgpu could not be loaded, so the 'mgpu' device is not available: "
            f"{type(err).__name__}: {err}. It was found at {where}. If that is a source checkout "
            f"(run from inside it, it shadows the installed package), build it there with "
            f"`pip install --no-build-isolation -e .` or run from another directory; if it was built "
            f"for another torch, rebuild it. TORCH_DEVICE_BACKEND_AUTOLOAD=0 stops torch from loading it.",
            RuntimeWarning,
            stacklevel=2,
        )
