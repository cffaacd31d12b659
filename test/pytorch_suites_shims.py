"""Names that PyTorch's test files at the commits docs/CONFORMANCE.md lists
use and torch 2.13.0 lacks (later PyTorch renamed MKLDNN to oneDNN in them):
each an alias of the 2.13 name (tf32_is_not_fp32: its old definition).
test/pytorch_suites.py runs it before the test files are imported."""
import torch
import torch.backends.mkldnn
import torch.testing._internal.common_cuda as common_cuda
import torch.testing._internal.common_device_type as common_device_type

# nn/test_convolution.py (4a4686d1): common_cuda.tf32_is_not_fp32, removed
# before 2.13; its old definition.
def tf32_is_not_fp32():
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    return torch.cuda.get_device_properties(torch.cuda.current_device()).major >= 8


if not hasattr(common_cuda, "tf32_is_not_fp32"):
    common_cuda.tf32_is_not_fp32 = tf32_is_not_fp32

# nn/test_convolution.py: common_device_type.disableOnednn / skipCPUIfNoOnednn
# (2.13: disableMkldnn / skipCPUIfNoMkldnn).
if not hasattr(common_device_type, "disableOnednn"):
    common_device_type.disableOnednn = common_device_type.disableMkldnn
if not hasattr(common_device_type, "skipCPUIfNoOnednn"):
    common_device_type.skipCPUIfNoOnednn = common_device_type.skipCPUIfNoMkldnn

# nn/test_convolution.py: torch.backends.onednn (2.13: torch.backends.mkldnn).
if not hasattr(torch.backends, "onednn"):
    torch.backends.onednn = torch.backends.mkldnn

# nn/test_convolution.py: torch._C._ConvBackend.Onednn / OnednnEmpty
# (2.13: Mkldnn / MkldnnEmpty).
for _new, _old in (("Onednn", "Mkldnn"), ("OnednnEmpty", "MkldnnEmpty")):
    if not hasattr(torch._C._ConvBackend, _new):
        setattr(torch._C._ConvBackend, _new, getattr(torch._C._ConvBackend, _old))
