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
- ``stack_chunks``: how often the plugin's frame-stack chunk allocator handed a kept chunk out
  again (``ternop.vllm_plugin.stack_chunks``), or None where it is not installed.
- ``numa``: the machine's NUMA nodes, the nodes of the CPUs in the affinity mask, and this
  process's resident pages on each node (``/proc/self/numa_maps``): a process whose heap sits
  on another node than its CPUs pays for every cache miss, which tight loops do not show.

The idle probes found the ternary process no slower while its queries were, so ``quick()``
repeats the small timings (and times making and dropping two views of a CUDA tensor, what
FlashAttention's KV-cache update does per layer) right after a query, ``CpuWindow``
counts the calling thread's page faults and context switches over the timed work, and
``GcWindow`` the garbage collections that ran in it and their time.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
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
        self._rusage = _thread_rusage()
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
        after = _thread_rusage()
        if self._rusage and after:  # the calling thread's page faults and context switches over the window
            out["caller_rusage"] = {k: after[k] - self._rusage[k] for k in after}
        if not self.ok:
            return {**out, "error": "no /proc on this system"}
        threads = self._busiest(self._threads, self._proc / "self" / "task", len(self._threads))
        out.update(threads=threads[:top], process_cpu_s=sum(t["cpu_s"] for t in threads), threads_alive=len(self._threads),
                   processes=self._busiest(self._pids, self._proc, top), self_pid=os.getpid())  # fmt: skip
        all1 = _busy_all()
        if self._all and all1 and all1[1] > self._all[1]:
            out["machine_busy_share"] = (all1[0] - self._all[0]) / (all1[1] - self._all[1])
        return out


class GcWindow:
    """The garbage collector's work over a stretch of this process's life, from ``gc.callbacks``:
    how many collections of each generation ran and the seconds they took, in any thread.

        w = GcWindow(); ...work...; w.report()   # -> {"collections": [g0, g1, g2], "seconds": s}

    Two engines' batches of the same work whose calling threads used different CPU time may
    differ in what the collector did (a larger heap makes each full collection longer); this says
    whether they did. ``report()`` ends the window.
    """

    def __init__(self) -> None:
        self._counts = [0, 0, 0]
        self._seconds = 0.0
        self._start: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._seconds += time.perf_counter() - self._start
            self._start = None
            generation = info.get("generation", 0)
            if 0 <= generation < len(self._counts):
                self._counts[generation] += 1

    def report(self) -> dict:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        return {"collections": list(self._counts), "seconds": self._seconds}


def _thread_rusage() -> dict | None:
    """The calling thread's minor/major page faults, voluntary/involuntary context switches and
    system CPU seconds (Linux ``RUSAGE_THREAD``), or None where that is not available."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return None
    r = resource.getrusage(who)
    return {"minflt": r.ru_minflt, "majflt": r.ru_majflt, "nvcsw": r.ru_nvcsw, "nivcsw": r.ru_nivcsw,
            "sys_s": r.ru_stime}  # fmt: skip


def _node_cpus() -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from sysfs (empty where sysfs has no nodes)."""
    nodes = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            text = (d / "cpulist").read_text().strip()
        except OSError:
            continue
        cpus: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        nodes[int(d.name[4:])] = cpus
    return nodes


def numa() -> dict:
    """The NUMA nodes, which of them hold the CPUs this process may run on, and its resident
    pages per node (summed over ``/proc/self/numa_maps``)."""
    nodes = _node_cpus()
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    pages: dict[str, int] = {}
    try:
        for line in Path("/proc/self/numa_maps").read_text().splitlines():
            for field in line.split()[2:]:
                if field[:1] == "N" and "=" in field:
                    node, _, count = field[1:].partition("=")
                    if node.isdigit():
                        pages[node] = pages.get(node, 0) + int(count)
    except (OSError, ValueError):
        pass
    try:  # "always" lets a page fault in a large anonymous mapping zero a whole 2 MiB page
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = None
    return {"nodes": len(nodes), "affinity_nodes": sorted(n for n, cpus in nodes.items() if cpus & mask),
            "pages_by_node": pages, "transparent_hugepage": thp}  # fmt: skip


def quick() -> dict:
    """About 10 ms of the probe's timings, taken right after a query instead of after an idle
    second: an empty call, a CPU ``torch.empty``, and with a GPU a tiny launch and two views of
    a CUDA tensor made and dropped (``transpose(1, 2).split(...)``, what FlashAttention's
    KV-cache update makes per layer). Medians of per-call times, in us (ns for the call)."""
    import torch

    def nothing():
        return None

    def median_us(fn, calls: int) -> float:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1e3

    out = {"python_call_ns": _per_call(nothing, 5_000) * 1e9, "torch_empty_us": median_us(lambda: torch.empty(8), 300)}
    if torch.cuda.is_available():
        kv = _quick_tensor()
        y = kv.view(-1)[:8]

        def views():
            key, value = kv.transpose(1, 2).split(64, dim=-1)
            del key, value

        out["views_us"] = median_us(views, 300)
        out["cuda_launch_us"] = median_us(lambda: y.add_(1), 200)
    return out


_QUICK: list = []


def _quick_tensor():
    """One small CUDA tensor laid out like a KV cache (blocks, K/V, tokens, heads, head size), made once per process."""
    import torch

    if not _QUICK:
        _QUICK.append(torch.zeros(4, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16))
    return _QUICK[0]


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
    chunks = sys.modules.get("ternop.vllm_plugin.stack_chunks")  # installed by the plugin, or not
    res["stack_chunks"] = chunks.stats() if chunks is not None else None
    res["numa"] = numa()
    res["idle_window"] = idle_window()
    return res


if __name__ == "__main__":
    import json

    print(json.dumps(probe(), indent=2))
