"""torch_mgpu demo: ops on mgpu are recorded, then run at a sync point."""
import os
import tempfile
import time

import torch

import torch_mgpu

torch.manual_seed(0)

print("== The basics: recorded, not run ==")
a = torch.randn(512, 512).to("mgpu")
b = torch.randn(512, 512, device="mgpu")
c = (a @ b).relu() + a.sum(dim=0)  # recorded, not run
print("pending ops:", torch_mgpu.pending_ops())
print("metadata without running:", c.shape, c.dtype, c.device)
result = c.cpu()  # runs the graph
a_cpu, b_cpu = a.cpu(), b.cpu()
expected = (a_cpu @ b_cpu).relu() + a_cpu.sum(dim=0)
print("equals eager CPU:", torch.equal(result, expected))
print(result[:2, :4])

print("\n== A branchy computation: 8 independent branches ==")
xs = [torch.randn(256, 256, device="mgpu") for _ in range(8)]
F = sum(torch.tanh(x @ x) for x in xs)
t0 = time.perf_counter()
F_cpu = F.cpu()
print(f"ran in {1e3 * (time.perf_counter() - t0):.2f} ms; F[0, :4] = {F_cpu[0, :4].tolist()}")
ref = sum(torch.tanh(x.cpu() @ x.cpu()) for x in xs)
print("matches eager:", torch.allclose(F_cpu, ref))
print(torch_mgpu.last_plan())

print("\n== Lanes side by side in a Chrome trace ==")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    sum(torch.tanh(x @ x) for x in xs).cpu()
trace = os.path.join(tempfile.gettempdir(), "torch_mgpu_trace.json")
prof.export_chrome_trace(trace)
lane_threads = {e.thread for e in prof.events() if e.name.startswith("mgpu::")}
print(f"{trace}: mgpu nodes recorded on {len(lane_threads)} thread(s) (open it in chrome://tracing or Perfetto)")

print("\n== Elementwise arithmetic runs as one pass ==")
w = torch.randn(100_000)
v = ((w.to("mgpu") * 0.5 + 1.0) * w.to("mgpu") - 0.25).relu() / 3
v_cpu = v.cpu()
plan = torch_mgpu.last_plan()
print(f"{plan.fused_nodes} of {len(plan)} nodes fused into one pass; "
      f"equals eager bitwise: {torch.equal(v_cpu, ((w * 0.5 + 1.0) * w - 0.25).relu() / 3)}")

print("\n== Kernel heads: four Cholesky solves, no sync until the result ==")
pts, targets = torch.randn(384, 8), torch.randn(384, 1)
def gp_means(p, t):
    d2 = torch.cdist(p, p).square()
    return [torch.cholesky_solve(t, torch.linalg.cholesky(torch.exp(-d2 / (2 * s * s)) + torch.eye(384, device=p.device)))
            for s in (0.5, 1.0, 2.0, 4.0)]
syncs = torch_mgpu.stats()["syncs"]
means = gp_means(pts.to("mgpu"), targets.to("mgpu"))
print("syncs while recording:", torch_mgpu.stats()["syncs"] - syncs)
got = torch.cat([m.cpu() for m in means], 1)
print("matches eager:", torch.allclose(got, torch.cat(gp_means(pts, targets), 1), rtol=1e-4, atol=1e-4),
      f"| lanes used: {torch_mgpu.last_plan().lanes_used}")
for _ in range(4):  # a cached plan is planned again once when its measured node times disagree with the model
    torch.cat(gp_means(pts.to("mgpu"), targets.to("mgpu")), 1).cpu()
plan = torch_mgpu.last_plan()
print(f"after 5 runs: predicted {plan.predicted_makespan * 1e3:.2f} ms, measured {plan.measured_makespan * 1e3:.2f} ms"
      f" ({'re-planned from measured node times' if plan.refined else 'the cost model was close enough to keep the plan'})")

print("\n== Training a module on mgpu ==")
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to("mgpu")
opt = torch.optim.Adam(model.parameters(), lr=0.01)
x = torch.randn(64, 16).to("mgpu")
y = x.sum(dim=1, keepdim=True)
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")

print("\n== A long capture runs while it is recorded ==")
z = torch.randn(256).to("mgpu")
z_ref = z.cpu()
before = torch_mgpu.stats()["background_flushes"]
for _ in range(1000):
    z = torch.sin(z) * 1.001
    z_ref = torch.sin(z_ref) * 1.001
print(f"2000 ops recorded; {torch_mgpu.stats()['background_flushes'] - before} flights of "
      f"{torch_mgpu.async_ops()} ops already ran in the background; {torch_mgpu.pending_ops()} still pending")
print("matches eager:", torch.equal(z.cpu(), z_ref))

print("\nstats:", torch_mgpu.stats())
