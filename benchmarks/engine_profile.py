"""torch.profiler inside a vLLM engine's own process, driven through ``LLM.apply_model``.

With the engine core in a process of its own (vLLM's default), a profiler in the calling process
sees neither the engine's kernels nor its host work. These functions run where the model is:

    llm.apply_model(engine_profile.start)
    ...                                     # the work to profile, from the calling process
    summary = llm.apply_model(functools.partial(engine_profile.stop, n=15, by="device"))[0]

vLLM sends the functions by reference, so the engine's process must import this module by name:
``bench_vllm.py`` puts this folder on its workers' PYTHONPATH. With the engine on the calling
thread the same calls profile that thread's process, as a plain ``torch.profiler.profile`` would.
"""

from __future__ import annotations

_PROFILER = None  # the running profiler of this process, between start() and stop()


def start(model=None) -> bool:
    """Starts recording CPU ops, and CUDA kernels where there is a GPU, in this process."""
    global _PROFILER
    import torch
    from torch.profiler import ProfilerActivity, profile

    if _PROFILER is not None:
        raise RuntimeError("engine_profile.start: a profile is already running in this process")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _PROFILER = profile(activities=activities)
    _PROFILER.start()
    return True


def stop(model=None, n: int = 15, by: str = "device") -> dict:
    """Stops the profile and summarises it: the ``n`` events with the most self time on the device
    (``by="device"``; the CPU where there is no GPU) or on the host (``by="cpu"``), with both times;
    ``self_us``, the self time of every event summed on that side (on the device an op such as
    ``aten::mm`` carries its kernels' time too, so that sum counts them twice); and
    ``device_busy_us``, the device time of the GPU's own events alone (kernels, copies), once each
    (None without a GPU)."""
    global _PROFILER
    import torch
    from torch.autograd import DeviceType

    if _PROFILER is None:
        raise RuntimeError("engine_profile.stop: no profile is running in this process (call start first)")
    prof, _PROFILER = _PROFILER, None
    prof.stop()
    key = "self_device_time_total" if by == "device" and torch.cuda.is_available() else "self_cpu_time_total"
    events = prof.key_averages()
    rows = [
        {"name": e.key[:120], "calls": e.count, "self_us": getattr(e, key, 0), "self_cpu_us": e.self_cpu_time_total}
        for e in sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:n]
    ]
    busy = None
    if torch.cuda.is_available():
        busy = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU)
    return {"top": rows, "self_us": sum(getattr(e, key, 0) for e in events), "device_busy_us": busy}
