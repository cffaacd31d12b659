"""Workload 9: whole training steps (forward, backward, Adam with a cosine
learning-rate schedule): an MLP, and a small GPT-style decoder (token and
position embeddings, causal self-attention blocks, a language-model head).
Each step changes the learning rate and Adam's bias corrections: tier 1
lifts those numbers into inputs of its compiled graph, so the step's graph
stays the same from step to step."""
import torch

from common import Case, gen


class GPT(torch.nn.Module):
    def __init__(self, vocab=512, d=128, heads=4, layers=2, seq=32):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        block = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok(tokens) + self.pos(pos)
        h = self.blocks(h, mask=self.causal, is_causal=True)
        return self.head(self.norm(h))


def step(model, opt, sched, x, y):
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach()


def cases(quick):
    batch, width = (16, 128) if quick else (64, 256)

    def make_mlp(device):
        torch.manual_seed(11)
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        g = gen(11)
        return model, opt, sched, torch.randn(batch, width, generator=g).to(device), \
            torch.randint(0, 10, (batch,), generator=g).to(device)

    def make_gpt(device):
        torch.manual_seed(12)
        model = GPT(layers=1 if quick else 2).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=3e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        g = gen(12)
        tokens = torch.randint(0, 512, (4 if quick else 8, 33), generator=g)
        return model, opt, sched, tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    stateful = {"stateful": True}  # each step trains its inputs (run.py's correctness guard)
    return [Case("training", f"MLP 4x{width} Adam+cosine batch {batch}", make_mlp, step, None, extra=stateful),
            Case("training", f"GPT {1 if quick else 2} layers 128 wide Adam+cosine", make_gpt, step, None,
                 extra=stateful)]
