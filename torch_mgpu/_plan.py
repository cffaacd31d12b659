"""torch_mgpu.last_plan(): what the last sync ran, where and when."""
from . import _C


class Plan:
    """The plan of one executed graph.

    `str(plan)` lists the nodes and lanes, `.to_dot()` gives graphviz,
    `.lanes` the lane names, `.predicted_makespan` / `.measured_makespan`
    seconds, `.timeline()` per-node dicts {node, op, lane, start, end}.
    """

    def __init__(self, record: dict):
        self._r = record
        self.lanes = list(record["lanes"])
        self.policy = record["policy"]
        self.predicted_makespan = record["predicted_makespan"]
        self.measured_makespan = record["measured_makespan"]
        self.graph_hash = record["graph_hash"]

    def timeline(self) -> list:
        return [dict(e) for e in self._r["timeline"]]

    def to_dot(self) -> str:
        return self._r["dot"]

    def __len__(self) -> int:
        return len(self._r["timeline"])

    def __str__(self) -> str:
        lines = [
            f"Plan: {len(self)} nodes on {len(self.lanes)} lane(s) [{', '.join(self.lanes)}], "
            f"policy {self.policy}",
            f"  predicted makespan {self.predicted_makespan * 1e3:.3f} ms, "
            f"measured {self.measured_makespan * 1e3:.3f} ms",
        ]
        for e in self.timeline():
            lines.append(
                f"  %{e['node']:<4} {e['op']:<32} {e['lane']:<14} "
                f"{e['start'] * 1e3:9.3f} .. {e['end'] * 1e3:9.3f} ms"
            )
        return "\n".join(lines)

    __repr__ = __str__


def last_plan():
    """The plan of the last executed graph, or None before the first sync."""
    r = _C._last_plan()
    return None if r is None else Plan(r)
