"""Runs PyTorch's own device-generic test files (test/test_modules.py,
test/nn/test_*.py, ... from a pytorch/pytorch checkout or an extract of one)
for one device, `mgpu` or `cpu`, on this build, and writes a per-test report.

    python test/pytorch_suites.py --tests /work/pt-tests/<sha>/test --device mgpu \\
        --files nn/test_dropout.py nn/test_pooling.py --timeout 300 \\
        --out /work/pt-tests/reports/nn-mgpu.txt
    python test/pytorch_suites.py --compare cpu.json mgpu.json   # mgpu-only failures

Not collected by the project's pytest run (the name is not test_*.py); the
pytorch test files are not part of this repository.

How a device is chosen: torch.testing._internal.common_device_type
instantiates every generic test class once per device type base in
`device_type_test_bases`, which holds PrivateUse1TestBase when the privateuse1
backend is registered and `torch.<name>.is_available()` at the time
common_device_type is imported. mgpu autoloads with `import torch` (the
`torch.backends` entry point `torch_mgpu_autoload`), so it is; the runner
imports torch_mgpu itself as well before any test file is imported. The
device is then restricted with PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1
(or cpu): classes become `TestFooPRIVATEUSE1` / `TestFooCPU`, tests
`test_bar_mgpu` / `test_bar_cpu`. Test classes that are not device-generic
(plain TestCase classes, which run on the CPU whatever the device) are left
out unless --all-classes is given, so that the two runs hold the same tests.

Timeouts: pytest runs in a child process. A test still running after
--timeout seconds gets a SIGALRM that raises inside it (it is reported
`timeout`); one stuck in native code, where that cannot land, has the stacks
of all its threads dumped (faulthandler) and the child is killed after a
grace period; it is reported `timeout` too (`crashed` for a child that died by
itself), and a new child runs the tests not yet run.

On mgpu, pending work is synchronized before and after every test (as the
project's own conftest does), so that an error raised when the graph runs is
reported by the test that recorded it (as an `error` in teardown when it
surfaces only there).

The report (--out REPORT) is text: one line per test (outcome, nodeid,
seconds, short reason), then totals; REPORT.json holds the same records.
Outcomes: passed, failed, error, skipped, xfailed, xpassed, timeout, crashed,
excluded (--exclude, or a known hang on that device; see DEFAULT_EXCLUDES).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

# Tests known to hang on a device: left out (reported `excluded`) unless
# --no-default-excludes. Matched as substrings of the test's name.
# Tests left out by default on a device (none today; LSTM's double backward
# was, until it was shown to finish, at ~2-4x the CPU's time).
DEFAULT_EXCLUDES: dict[str, list[str]] = {
    "mgpu": [],
    "cpu": [],
}

DEVICE_ONLY_FOR = {"mgpu": "privateuse1", "cpu": "cpu"}
DEVICE_CLASS_SUFFIX = {"mgpu": "PRIVATEUSE1", "cpu": "CPU"}

OUTCOMES = ["passed", "failed", "error", "timeout", "crashed", "skipped",
            "xfailed", "xpassed", "excluded"]


# ----------------------------------------------------------------------------
# The pytest plugin (runs in the child process)
# ----------------------------------------------------------------------------

class TestTimeout(BaseException):
    """Raised in a test that ran past the timeout (BaseException, so that a
    test's own `except Exception` does not swallow it)."""


def _short(text: str, lines: int = 2, width: int = 400) -> str:
    parts = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    # common_utils appends how to rerun the test: not a reason
    for i, p in enumerate(parts):
        if p.startswith(("To execute this test", "This message can be suppressed")):
            parts = parts[:i]
            break
    out = " | ".join(parts[:lines])
    return out if len(out) <= width else out[: width - 3] + "..."


def _reason(report) -> str:
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple) and len(lr) == 3:  # a skip: (path, line, reason)
        return _short(lr[2].removeprefix("Skipped: "), 1)
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return _short(crash.message)
    return _short(str(lr).strip().splitlines()[-1] if str(lr).strip() else "")


class Plugin:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.progress = open(cfg["progress"], "a", buffering=1)
        self.skip = set(cfg.get("skip", []))
        self.excludes = cfg.get("excludes", [])
        self.phases: dict[str, list] = {}
        self.started: dict[str, float] = {}
        self.tb_file = open(cfg["tracebacks"], "a", buffering=1)
        self.sync = None

    def _emit(self, kind: str, **rec):
        rec["kind"] = kind
        self.progress.write(json.dumps(rec) + "\n")
        self.progress.flush()

    # -- setup ---------------------------------------------------------------
    def pytest_configure(self, config):
        import torch  # noqa: F401  (autoloads mgpu)
        if self.cfg["device"] == "mgpu":
            import torch_mgpu
            self.sync = torch_mgpu.synchronize
            assert torch._C._get_privateuse1_backend_name() == "mgpu"
            assert torch.mgpu.is_available()
        shim = self.cfg.get("shim")
        if shim:
            import runpy
            runpy.run_path(shim, run_name="pt_shims")

        def on_alarm(signum, frame):
            raise TestTimeout(f"test ran past the {self.cfg['timeout']}s timeout")

        signal.signal(signal.SIGALRM, on_alarm)

    def pytest_collectreport(self, report):
        if report.failed:
            self._emit("collecterror", nodeid=report.nodeid or "<collection>",
                       reason=_reason(report))

    @staticmethod
    def _name(nodeid: str) -> str:
        return nodeid.rsplit("::", 1)[-1]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        keep, dropped = [], []
        suffix = DEVICE_CLASS_SUFFIX[self.cfg["device"]]
        for item in items:
            nid = item.nodeid
            parts = nid.split("::")
            cls = parts[-2] if len(parts) >= 3 else ""
            if nid in self.skip:
                dropped.append(item)
            elif not self.cfg["all_classes"] and not cls.endswith(suffix):
                dropped.append(item)
            elif any(x in self._name(nid) for x in self.excludes):
                self._emit("end", nodeid=nid, outcome="excluded", duration=0.0,
                           reason="excluded: " + ", ".join(
                               x for x in self.excludes if x in self._name(nid)))
                dropped.append(item)
            else:
                keep.append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        self._emit("collected", count=len(keep))

    # -- per test ------------------------------------------------------------
    def pytest_runtest_logstart(self, nodeid, location):
        import faulthandler
        self.phases[nodeid] = []
        self.started[nodeid] = time.time()
        self._emit("start", nodeid=nodeid, t=self.started[nodeid])
        self.tb_file.write(f"\n=== {nodeid}\n")
        faulthandler.dump_traceback_later(
            self.cfg["timeout"] + self.cfg["grace"] / 2, repeat=False, file=self.tb_file)
        signal.setitimer(signal.ITIMER_REAL, self.cfg["timeout"])

    def _pending_sync(self):
        if self.sync is not None:
            self.sync()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._pending_sync()

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item, nextitem):
        self._pending_sync()

    def pytest_runtest_logreport(self, report):
        self.phases.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid, location):
        import faulthandler
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        reps = self.phases.pop(nodeid, [])
        failed = next((r for r in reps if r.failed), None)
        skipped = next((r for r in reps if r.skipped), None)
        call = next((r for r in reps if r.when == "call"), None)
        if failed is not None:
            if "TestTimeout" in str(failed.longrepr):
                outcome, reason = "timeout", _reason(failed)
            elif failed.when == "call":
                outcome, reason = "failed", _reason(failed)
            else:
                outcome, reason = "error", f"[{failed.when}] " + _reason(failed)
        elif skipped is not None:
            if hasattr(skipped, "wasxfail"):
                outcome, reason = "xfailed", _short(skipped.wasxfail or _reason(skipped), 1)
            else:
                outcome, reason = "skipped", _reason(skipped)
        elif call is not None and hasattr(call, "wasxfail"):
            outcome, reason = "xpassed", _short(call.wasxfail, 1)
        else:
            outcome, reason = "passed", ""
        dur = time.time() - self.started.pop(nodeid, time.time())
        self._emit("end", nodeid=nodeid, outcome=outcome, duration=round(dur, 3),
                   reason=reason)


def child_main(argv: list[str]) -> int:
    cfg = json.loads(os.environ["PTS_CONFIG"])
    return int(pytest.main(argv, plugins=[Plugin(cfg)]))


# ----------------------------------------------------------------------------
# The parent: runs children, restarts after a hang or a crash, writes reports
# ----------------------------------------------------------------------------

def _read_new(path: str, pos: int):
    try:
        with open(path) as f:
            f.seek(pos)
            data = f.read()
    except FileNotFoundError:
        return [], pos
    # only whole lines
    cut = data.rfind("\n") + 1
    lines = [json.loads(ln) for ln in data[:cut].splitlines() if ln.strip()]
    return lines, pos + cut


def run(args) -> int:
    tests_dir = os.path.abspath(args.tests)
    files = args.files or ["test_modules.py"]
    for f in files:
        if not os.path.exists(os.path.join(tests_dir, f)):
            sys.exit(f"no such test file: {os.path.join(tests_dir, f)}")
    shim = args.shim
    if shim is None:
        for cand in (os.path.join(tests_dir, "pt_shims.py"),
                     os.path.join(os.path.dirname(tests_dir), "pt_shims.py"),
                     os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytorch_suites_shims.py")):
            if os.path.exists(cand):
                shim = cand
                break
    excludes = list(args.exclude or [])
    if not args.no_default_excludes:
        excludes += DEFAULT_EXCLUDES[args.device]

    work = tempfile.mkdtemp(prefix="pytorch_suites_")
    progress = os.path.join(work, "progress.jsonl")
    tracebacks = (args.out + ".tracebacks.txt") if args.out else os.path.join(work, "tb.txt")
    open(tracebacks, "w").close()
    ini = os.path.join(work, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")

    env = dict(os.environ)
    env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = DEVICE_ONLY_FOR[args.device]
    env.pop("PYTORCH_TESTING_DEVICE_EXCEPT_FOR", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.device == "cpu" and args.no_autoload_on_cpu:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

    pytest_args = ["-p", "no:cacheprovider", "-q", "-rN", "--tb=short",
                   "--color=no", "-c", ini, "--rootdir", tests_dir]
    if args.k:
        pytest_args += ["-k", args.k]
    pytest_args += list(args.pytest_arg or [])
    pytest_args += files

    here = os.path.dirname(os.path.abspath(__file__))
    boot = ("import sys; sys.path.insert(0, %r); import pytorch_suites as p; "
            "sys.path.pop(0); sys.exit(p.child_main(sys.argv[1:]))" % here)

    records: dict[str, dict] = {}
    collect_errors: list[dict] = []
    log = open(args.out + ".log", "w") if args.out else None
    restarts, t0 = 0, time.time()
    while True:
        cfg = {"device": args.device, "timeout": args.timeout, "grace": args.grace,
               "progress": progress, "tracebacks": tracebacks, "shim": shim,
               "excludes": excludes, "all_classes": args.all_classes,
               "skip": sorted(records)}
        env["PTS_CONFIG"] = json.dumps(cfg)
        open(progress, "w").close()
        pos = 0
        child = subprocess.Popen([sys.executable, "-c", boot] + pytest_args,
                                 cwd=tests_dir, env=env, start_new_session=True,
                                 stdout=log or subprocess.DEVNULL,
                                 stderr=subprocess.STDOUT)
        current, started, new_tests, hung = None, 0.0, 0, False
        while True:
            rc = child.poll()
            lines, pos = _read_new(progress, pos)
            for rec in lines:
                if rec["kind"] == "start":
                    current, started = rec["nodeid"], time.time()
                    new_tests += 1
                elif rec["kind"] == "end":
                    records[rec["nodeid"]] = {k: rec[k] for k in
                                              ("nodeid", "outcome", "duration", "reason")}
                    if rec["nodeid"] == current:
                        current = None
                    if args.verbose:
                        print(f"{rec['outcome']:8} {rec['nodeid']}", flush=True)
                elif rec["kind"] == "collecterror":
                    if not any(c["nodeid"] == rec["nodeid"] for c in collect_errors):
                        collect_errors.append({"nodeid": rec["nodeid"], "outcome": "error",
                                               "duration": 0.0,
                                               "reason": "[collection] " + rec["reason"]})
            if rc is not None:
                break
            if current is not None and time.time() - started > args.timeout + args.grace:
                hung = True
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.wait()
                records[current] = {"nodeid": current, "outcome": "timeout",
                                    "duration": round(time.time() - started, 3),
                                    "reason": f"hung past {args.timeout}s + {args.grace}s "
                                              "grace; killed (stacks in the .tracebacks.txt)"}
                break
            time.sleep(0.2)
        if not hung and current is not None:
            # the child died inside a test (a crash, a signal, os._exit)
            records[current] = {"nodeid": current, "outcome": "crashed",
                                "duration": round(time.time() - started, 3),
                                "reason": f"the test process died (exit status {rc})"}
        if not hung and current is None:
            break  # a clean end of the run
        restarts += 1
        if new_tests == 0 or restarts > args.max_restarts:
            print("giving up restarting: no progress", file=sys.stderr)
            break
        if log:
            log.write(f"\n==== restart {restarts} after {current} ====\n")
            log.flush()
    wall = time.time() - t0
    if log:
        log.close()

    all_recs = collect_errors + sorted(records.values(), key=lambda r: r["nodeid"])
    totals = {o: 0 for o in OUTCOMES}
    for r in all_recs:
        totals[r["outcome"]] = totals.get(r["outcome"], 0) + 1
    meta = {"device": args.device, "tests_dir": tests_dir, "files": files, "k": args.k,
            "timeout": args.timeout, "excludes": excludes, "shim": shim,
            "all_classes": args.all_classes, "restarts": restarts,
            "wall_s": round(wall, 1), "argv": sys.argv,
            "python": sys.executable}
    try:
        import importlib.metadata as md
        meta["torch"] = md.version("torch")
    except Exception:
        pass
    summary = ", ".join(f"{n} {o}" for o, n in totals.items() if n)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(f"# {' '.join(sys.argv)}\n# device={args.device} files={files} "
                    f"k={args.k!r} timeout={args.timeout}s wall={wall:.0f}s "
                    f"restarts={restarts}\n")
            for r in all_recs:
                f.write(f"{r['outcome']:8} {r['nodeid']}  [{r['duration']:.2f}s]"
                        + (f"  {r['reason']}" if r["reason"] else "") + "\n")
            f.write("# totals: " + summary + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "totals": totals, "records": all_recs}, f, indent=1)
    print(f"{args.device} {' '.join(files)}: {summary} ({wall:.0f}s)")
    return 0


# ----------------------------------------------------------------------------
# Comparing a cpu report with an mgpu report
# ----------------------------------------------------------------------------

def _normalize(nodeid: str, device: str) -> str:
    if device == "mgpu":
        nodeid = nodeid.replace("PRIVATEUSE1::", "CPU::")
        head, _, name = nodeid.rpartition("::")
        name = re.sub(r"_mgpu(?=_|$)", "_cpu", name, count=1)
        nodeid = head + "::" + name
    return nodeid


def compare(cpu_json: str, mgpu_json: str, out: str | None) -> int:
    cpu = json.load(open(cpu_json))
    mg = json.load(open(mgpu_json))
    cpu_by = {_normalize(r["nodeid"], "cpu"): r for r in cpu["records"]}
    bad = ("failed", "error", "timeout", "crashed")
    rows = []
    for r in mg["records"]:
        if r["outcome"] not in bad:
            continue
        c = cpu_by.get(_normalize(r["nodeid"], "mgpu"))
        if c is not None and c["outcome"] in ("passed", "xfailed"):
            rows.append((r, c))
    lines = [f"# mgpu {', '.join(f'{n} {o}' for o, n in mg['totals'].items() if n)}",
             f"# cpu  {', '.join(f'{n} {o}' for o, n in cpu['totals'].items() if n)}",
             f"# {len(rows)} tests fail on mgpu and pass on cpu"]
    for r, c in rows:
        lines.append(f"{r['outcome']:8} {r['nodeid']}  {r['reason']}")
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", help="the folder the test files are in (pytorch's test/)")
    ap.add_argument("--device", choices=["mgpu", "cpu"], default="mgpu")
    ap.add_argument("--files", nargs="+", help="test files, relative to --tests")
    ap.add_argument("-k", help="pytest -k expression")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds after the timeout before a stuck child is killed")
    ap.add_argument("--out", help="report file (text); REPORT.json, REPORT.log and "
                    "REPORT.tracebacks.txt are written beside it")
    ap.add_argument("--exclude", action="append",
                    help="leave out tests whose name contains this (repeatable)")
    ap.add_argument("--no-default-excludes", action="store_true",
                    help="run the known hangs of DEFAULT_EXCLUDES too")
    ap.add_argument("--all-classes", action="store_true",
                    help="keep the test classes that are not device-generic")
    ap.add_argument("--shim", help="a python file run before the tests are imported "
                    "(default: pt_shims.py in --tests or its parent, if there)")
    ap.add_argument("--no-autoload-on-cpu", action="store_true",
                    help="on cpu, TORCH_DEVICE_BACKEND_AUTOLOAD=0 (mgpu not loaded)")
    ap.add_argument("--pytest-arg", action="append", help="extra pytest argument")
    ap.add_argument("--max-restarts", type=int, default=50)
    ap.add_argument("-v", "--verbose", action="store_true", help="print each test")
    ap.add_argument("--compare", nargs=2, metavar=("CPU_JSON", "MGPU_JSON"),
                    help="list tests failing on mgpu and passing on cpu, and stop")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare[0], args.compare[1], args.out)
    if not args.tests:
        ap.error("--tests is required")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
