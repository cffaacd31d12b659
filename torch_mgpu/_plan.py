"""torch_mgpu.last_plan(): what the last sync ran, where and when."""
from . import _C


class Plan:
    """The plan of one executed graph.

    `str(plan)` lists the nodes and lanes, `.to_dot()` gives graphviz,
    `.lanes` the lane names, `.predicted_makespan` / `.measured_makespan`
    seconds, `.timeline()` per-node dicts {node, op, lane, start, end,
    fused}, `.fused_nodes` how many nodes ran inside fused pointwise passes,
    `.refined` whether the graph was planned again with the node times its
    first runs measured. `.tier`: 0 when the graph ran node by node, 1 when
    it ran as code compiled in the background (`configure(compile=...)`),
    2 when it replayed the recording of an earlier run on stream lanes;
    `.compiled` what the compiled code is, `.replay` whether the graph was
    recorded or replayed, or why it is not replayed ("" when it was not hot).
    """

    def __init__(self, record):
        self._rec = record  # read on demand: text, graphviz and the timeline cost per node
        head = record.summary()
        self.lanes = list(head["lanes"])
        self.policy = head["policy"]
        self.predicted_makespan = head["predicted_makespan"]
        self.measured_makespan = head["measured_makespan"]
        self.refined = head["refined"]
        self.graph_hash = head["graph_hash"]
        self.tier = head["tier"]
        self.compiled = head["compiled"]
        self.replay = head["replay"]
        self.lanes_used = head["lanes_used"]
        self.transfers = head["transfers"]
        # Lanes on other ranks: bytes of values sent to and received from workers.
        self.remote_bytes_sent = head["remote_bytes_sent"]
        self.remote_bytes_received = head["remote_bytes_received"]
        self.remote_bytes_between_workers = head["remote_bytes_between_workers"]
        self.fused_nodes = head["fused_nodes"]
        self._nodes = head["nodes"]
        self._timeline = None

    def _entries(self) -> list:
        if self._timeline is None:
            self._timeline = self._rec.timeline()
        return self._timeline

    def timeline(self) -> list:
        """Per node: {node, op, lane, start, end} measured (seconds from the
        start of execution), predicted_start / predicted_end, `threads`: the
        intra-op threads it ran with, and `fused`: the pointwise group the
        node ran in as one pass (-1: it ran alone; a group's measured time is
        shared out evenly over its nodes)."""
        return [dict(e) for e in self._entries()]

    def partitions(self) -> list:
        """The torch.compile partitions (backend="mgpu") among the nodes:
        per partition node, {name, ops, kernels, lane, measured, predicted}
        (seconds), ops being the ATen ops it computes in graph order."""
        from .compile import partition_info

        out = []
        for e in self._entries():
            info = partition_info(e["op"]) if e["op"].startswith("partition#") else None
            if info is not None:
                out.append({"name": info.name, "ops": list(info.ops), "kernels": info.kernels, "lane": e["lane"],
                            "measured": e["end"] - e["start"],
                            "predicted": e["predicted_end"] - e["predicted_start"]})
        return out

    def busy_lanes(self) -> set:
        return {e["lane"] for e in self._entries()}

    def max_concurrency(self) -> int:
        """Most nodes measured running at the same instant."""
        events = []
        for e in self._entries():
            if e["end"] > e["start"]:
                events += [(e["start"], 1), (e["end"], -1)]
        best = cur = 0
        for _, d in sorted(events, key=lambda x: (x[0], x[1])):
            cur += d
            best = max(best, cur)
        return best

    def to_dot(self) -> str:
        return self._rec.dot()

    def __len__(self) -> int:
        return self._nodes

    def __str__(self) -> str:
        lines = [
            f"Plan: {len(self)} nodes on {self.lanes_used} of {len(self.lanes)} lane(s) "
            f"[{', '.join(self.lanes)}], policy {self.policy}, {self.transfers} transfer(s)"
            + (f", {self.remote_bytes_sent} bytes to and {self.remote_bytes_received} from other ranks"
               if self.remote_bytes_sent or self.remote_bytes_received else "")
            + (f", {self.remote_bytes_between_workers} between them"
               if self.remote_bytes_between_workers else "")
            + (", refined by measured node times" if self.refined else "")
            + (f", tier 1: compiled {self.compiled}" if self.tier == 1 else "")
            + (f", tier 2: {self.replay}" if self.tier == 2 else ""),
            f"  predicted makespan {self.predicted_makespan * 1e3:.3f} ms, "
            f"measured {self.measured_makespan * 1e3:.3f} ms"
            + (f", {self.fused_nodes} node(s) fused" if self.fused_nodes else ""),
        ]
        for e in self.timeline():
            lines.append(
                f"  %{e['node']:<4} {e['op']:<32} {e['lane']:<14} "
                f"{e['start'] * 1e3:9.3f} .. {e['end'] * 1e3:9.3f} ms "
                f"(predicted {e['predicted_start'] * 1e3:.3f} .. {e['predicted_end'] * 1e3:.3f})"
                + (f" fused#{e['fused']}" if e["fused"] >= 0 else "")
            )
        return "\n".join(lines)

    __repr__ = __str__


def last_plan():
    """The plan of the last executed graph, or None before the first sync."""
    r = _C._last_plan()
    return None if r is None else Plan(r)


class Simulation:
    """What simulate() predicts: `makespan`, `lower_bound` (max of
    `critical_path` and `total_work` over the lanes), seconds, and `plan`."""

    def __init__(self, r: dict):
        self.makespan = r["makespan"]
        self.lower_bound = r["lower_bound"]
        self.critical_path = r["critical_path"]
        self.total_work = r["total_work"]
        self.plan = Plan(r["plan"]) if r["plan"] is not None else None

    def __repr__(self) -> str:
        return (f"Simulation(makespan={self.makespan * 1e3:.3f} ms, lower_bound={self.lower_bound * 1e3:.3f} ms, "
                f"critical_path={self.critical_path * 1e3:.3f} ms, total_work={self.total_work * 1e3:.3f} ms)")


def simulate(devices: int = 1, lanes_per_device: int = 1, policy: str = None, device: str = None,
             hosts: int = 1) -> Simulation:
    """Plans the pending graph for `devices` virtual devices with
    `lanes_per_device` lanes each, without running anything.

    `device` names a GPU profile (`torch_mgpu.device_profiles()`: "h100",
    "a100", ...): the plan is then for `devices` such GPUs with
    `lanes_per_device` streams each, whatever this machine has. A GPU's
    streams share it: kernels that each fill the device do not overlap.

    `hosts` > 1 plans for that many processes: this one with the devices
    above, each other one a worker rank with one lane ("rank1:cpu/lane0";
    with `device`, one GPU of that profile: "rank1:cuda:0/stream0"), behind
    the network measured at `configure` (or the cost model's figures where
    no worker was configured).

    Only what is pending is planned: with background execution on (see
    `torch_mgpu.set_async_ops`), a capture longer than `async_ops()` ops has
    partly run already, so turn it off to simulate a whole program."""
    return Simulation(_C._simulate(int(devices), int(lanes_per_device), policy or "", device or "", int(hosts)))


def device_profiles() -> dict:
    """The built-in GPU profiles `simulate(device=...)` plans for: name ->
    published figures (SMs, sustained FP32 rate, memory bandwidth, launch
    latency, host and peer link bandwidths, memory)."""
    return _C._device_profiles()
