"""torch.compile(model, backend="mgpu").

Dynamo hands the backend an FX graph of the user's function; running that
graph on mgpu tensors records its ATen ops into the lazy graph like eager
code does, so the backend runs the captured graph as is (after AOT autograd
for training graphs), and torch_mgpu plans and executes it at the sync
point. Registered under the name "mgpu" on import and through the
`torch_dynamo_backends` entry point.
"""
import torch


def mgpu_backend(gm: torch.fx.GraphModule, example_inputs):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(fx_module, _inputs):
        return make_boxed_func(fx_module.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)(gm, example_inputs)


def register():
    from torch._dynamo import list_backends, register_backend

    if "mgpu" not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=mgpu_backend, name="mgpu")
