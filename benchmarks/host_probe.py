"""Is this process's host side slow for reasons outside the model?

    from host_probe import probe; probe()   # -> dict, about 1.5 s

A profiled single query of the ternary embedder in vLLM spent 1.4x-3.3x more host time than the
bf16 one in every host-side entry (the attention wrapper, the KV-cache update, even
``cudaLaunchKernel`` and ``aten::empty_strided``), ops that do the same work in both
engines. A uniform slow-down like that points at the process or the machine, not at an op:
a thread of the same process spinning beside the main one, a trace or frame hook that every
Python call pays, a larger heap for the garbage collector, fewer CPUs in the affinity mask,
or another process using the cores. Each engine's worker calls this between the timed runs,
and the JSON records the answers side by side.

What it reports:
- ``python_call_ns``: one empty Python function call; ``torch_empty_us``: one ``torch.empty``
  on the CPU; ``cuda_launch_us`` (with a GPU): host time of one tiny in-place kernel launch.
  These do the same work in every process, so a difference between engines is the process's.
- ``idle_window``: over one second of ``time.sleep``: this process's CPU seconds by thread
  (the busiest five, by name), and the busiest five processes of the machine with the share
  of all CPUs in use. An idle engine should use next to nothing.
- ``hooks``: ``sys.gettrace()`` / ``sys.getprofile()`` set or not; ``gc``: tracked objects,
  frozen objects, whether the collector is on; ``cpus``: the affinity mask's size and
  ``torch.get_num_threads()``.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path


def _per_call(fn, calls: int) -> float:
    """Median seconds per call over three timed loops."""
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls)
    return sorted(runs)[1]


def _ticks(path: Path) -> int | None:
    """utime + stime (clock ticks) from a /proc .../stat file, or None if it is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[11]) + int(fields[12])


def _comm(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def _busy_all() -> tuple[int, int] | None:
    try:
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


class CpuWindow:
    """CPU used over a stretch of this process's life: by each of its threads, by the busiest
    processes of the machine, by the calling thread, and the machine's busy share.

        w = CpuWindow(); ...work...; w.report()   # -> dict

    Around timed work it says whether that work's time was the calling thread's own CPU time
    (``caller_cpu_s`` close to ``wall_s``), spent waiting (far below it), or shared with other
    busy threads of the process (``threads`` beyond the caller) or of the machine.
    """

    def __init__(self) -> None:
        self._proc = Path("/proc")
        self.ok = (self._proc / "self" / "task").is_dir()
        self._hz = os.sysconf("SC_CLK_TCK") if self.ok else 100
        self._threads = {p.name: _ticks(p / "stat") for p in (self._proc / "self" / "task").iterdir()} if self.ok else {}
        self._pids = {p.name: _ticks(p / "stat") for p in self._proc.iterdir() if p.name.isdigit()} if self.ok else {}
        self._all = _busy_all() if self.ok else None
        self._caller = time.thread_time()
        self._wall = time.perf_counter()

    def _busiest(self, before: dict, base: Path, top: int) -> list[dict]:
        rows = []
        for key, t0 in before.items():
            t1 = _ticks(base / key / "stat")
            if t0 is not None and t1 is not None and t1 > t0:
                rows.append({"name": _comm(base / key / "comm"), "id": int(key), "cpu_s": (t1 - t0) / self._hz})
        return sorted(rows, key=lambda r: -r["cpu_s"])[:top]

    def report(self, top: int = 5) -> dict:
        out = {"wall_s": time.perf_counter() - self._wall, "caller_cpu_s": time.thread_time() - self._caller}
        if not self.ok:
            return {**out, "error": "no /proc on this system"}
        threads = self._busiest(self._threads, self._proc / "self" / "task", len(self._threads))
        out.update(threads=threads[:top], process_cpu_s=sum(t["cpu_s"] for t in threads), threads_alive=len(self._threads),
                   processes=self._busiest(self._pids, self._proc, top), self_pid=os.getpid())  # fmt: skip
        all1 = _busy_all()
        if self._all and all1 and all1[1] > self._all[1]:
            out["machine_busy_share"] = (all1[0] - self._all[0]) / (all1[1] - self._all[1])
        return out


def idle_window(seconds: float = 1.0, top: int = 5) -> dict:
    """CPU used while this process sleeps: its threads', the busiest processes', the machine's."""
    window = CpuWindow()
    time.sleep(seconds)
    out = window.report(top)
    out["seconds"] = seconds
    return out


def probe() -> dict:
    import torch

    def nothing():
        return None

    x = torch.zeros(8)
    res = {
        "python_call_ns": _per_call(nothing, 200_000) * 1e9,
        "torch_empty_us": _per_call(lambda: torch.empty(8), 20_000) * 1e6,
        "torch_add_us": _per_call(lambda: x.add_(1), 20_000) * 1e6,
    }
    if torch.cuda.is_available():
        y = torch.zeros(8, device="cuda")
        torch.cuda.synchronize()
        res["cuda_launch_us"] = _per_call(lambda: y.add_(1), 5_000) * 1e6
        torch.cuda.synchronize()
    res["hooks"] = {"trace": sys.gettrace() is not None, "profile": sys.getprofile() is not None}
    res["gc"] = {"enabled": gc.isenabled(), "tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
                 "counts": list(gc.get_count())}  # fmt: skip
    res["cpus"] = {"affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                   "os": os.cpu_count(), "torch_threads": torch.get_num_threads()}  # fmt: skip
    res["idle_window"] = idle_window()
    return res


if __name__ == "__main__":
    import json

    print(json.dumps(probe(), indent=2))
