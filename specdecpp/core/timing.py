"""The project's one forward timer, through ``torch.utils.benchmark.Timer``.

``Timer`` reads its clock after synchronising the accelerator (CUDA), so a GPU forward is timed to
its last kernel, not to its launch; on a CPU it is ``timeit``'s clock, with the caller's torch
thread count (``Timer`` would otherwise time with one thread). Each call is timed on its own
(``Timer.timeit(1)``, which first runs the call twice untimed as its own warm-up), with ``reset``
as the Timer's untimed setup: every timed call starts from the same state (a cache rolled back to
the same length). Several calls are interleaved call by call, so machine load touches all alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch
from torch.utils.benchmark import Timer


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed call (warm-up calls excluded)."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)


def time_forwards(calls: Mapping[Hashable, Callable[[], object]], *, repeats: int = 20, warmup: int = 3,
                  resets: Mapping[Hashable, Callable[[], object]] | None = None,
                  until: Callable[[], bool] | None = None) -> dict[Hashable, Timing]:
    """Time every call of ``calls`` ``repeats`` times, interleaved (call a, call b, ..., then again),
    after ``warmup`` untimed rounds; ``resets[key]`` runs untimed before each timed call of ``key``
    (and once at the end, so the caller's state is left reset).

    ``until``: instead of a fixed count, keep going (at least one timed round) until it returns
    True, e.g. a ``threading.Event.is_set`` while another process competes for the machine.
    """
    if repeats < 1 and until is None:
        raise ValueError(f"time_forwards: repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"time_forwards: warmup must be >= 0, got {warmup}")
    resets = resets or {}
    unknown = set(resets) - set(calls)
    if unknown:
        raise ValueError(f"time_forwards: resets for unknown calls {sorted(map(str, unknown))}")
    threads = torch.get_num_threads()
    timers = {key: Timer(stmt="fn()", setup="reset()" if key in resets else "pass", num_threads=threads,
                         globals={"fn": fn, "reset": resets.get(key)}) for key, fn in calls.items()}
    times: dict[Hashable, list[float]] = {key: [] for key in calls}
    i = 0
    while True:
        for key, timer in timers.items():
            seconds = timer.timeit(1).raw_times[0]
            if i >= warmup:
                times[key].append(seconds)
        i += 1
        done = i - warmup
        if done >= 1 and (until() if until is not None else done >= repeats):
            break
    for reset in resets.values():
        reset()
    return {key: Timing(tuple(t)) for key, t in times.items()}


def time_forward(call: Callable[[], object], *, repeats: int = 20, warmup: int = 3,
                 reset: Callable[[], object] | None = None, until: Callable[[], bool] | None = None) -> Timing:
    """:func:`time_forwards` of one call: ``time_forward(fn, reset=undo).median`` is its seconds."""
    return time_forwards({0: call}, repeats=repeats, warmup=warmup, until=until,
                         resets=None if reset is None else {0: reset})[0]


def machine_description(device: torch.device | str = "cpu") -> str:
    """The machine a figure was measured on, for its report: the CUDA device's name, or the CPU's
    model name (``/proc/cpuinfo``), its core count and whether it multiplies bf16 in hardware
    (AVX512-BF16 / AMX, which set bf16 speed apart between CPUs), with torch's version and threads."""
    import os
    import platform

    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    bf16 = [name for name, key in (("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16")) if caps.get(key)]
    return (f"{model}, {os.cpu_count()} cores, bf16 in hardware: {' + '.join(bf16) or 'no'}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")


class Clock:
    """perf_counter, after synchronising the calling thread's CUDA stream so that its queued
    kernels are counted (a second thread's stream is left alone). ``sync=False`` on CUDA reads the
    time without waiting (only meaningful around a final synchronised mark); ``exact`` tells
    whether a reading counts the queued work (always on CPU)."""

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.sync = sync

    @property
    def exact(self) -> bool:
        return self.sync or not self.cuda

    def now(self) -> float:
        if self.cuda and self.sync:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()
