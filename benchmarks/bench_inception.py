"""Workload 5: an Inception-style block (parallel convolution towers), forward and backward."""
import torch

from common import Case, gen


class Inception(torch.nn.Module):
    def __init__(self, c=32):
        super().__init__()
        conv = torch.nn.Conv2d
        self.b1 = conv(c, 16, 1)
        self.b2 = torch.nn.Sequential(conv(c, 16, 1), torch.nn.ReLU(), conv(16, 24, 3, padding=1))
        self.b3 = torch.nn.Sequential(conv(c, 8, 1), torch.nn.ReLU(), conv(8, 12, 5, padding=2))
        self.b4 = torch.nn.Sequential(torch.nn.MaxPool2d(3, 1, 1), conv(c, 12, 1))

    def forward(self, x):
        return torch.cat([torch.relu(self.b1(x)), torch.relu(self.b2(x)), torch.relu(self.b3(x)),
                          torch.relu(self.b4(x))], 1)


def cases(quick):
    batch, hw = (4, 16) if quick else (16, 32)
    def make(device):
        torch.manual_seed(7)
        m = Inception().to(device)
        x = torch.randn(batch, 32, hw, hw, generator=gen(7)).to(device)
        return m, x
    def fwd_bwd(m, x):
        m.zero_grad(set_to_none=True)
        out = m(x)
        out.square().mean().backward()
        return [p.grad for p in m.parameters()]
    return [Case("inception", f"fwd+bwd batch {batch} {hw}x{hw}", make, fwd_bwd, None)]
