"""Where does a MemoryMonitor logging step spend its time? Hook timings of variants, then cProfile of the hooks.

    PYTHONPATH=. python3 benchmarks/profile_monitor.py     # GPU; on CPU it uses monitor_overhead's --quick model
    PYTHONPATH=. python3 benchmarks/profile_monitor.py --default-only   # the default settings only, then the profile

"presync" synchronises the GPU before timing each hook: if a hook waits for the GPU, its time drops there.
"""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import monitor_overhead as mo

from lightning_gpumem import MemoryMonitor


def run(settings, data, monitor, prof=None, presync=False, steps=150):
    times = []
    for name in ("on_train_batch_start", "on_train_batch_end"):
        original = getattr(monitor, name)

        def wrapped(*args, _original=original, **kwargs):
            if presync and torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter_ns()
            if prof:
                prof.enable()
            _original(*args, **kwargs)
            if prof:
                prof.disable()
            times.append(time.perf_counter_ns() - start)

        setattr(monitor, name, wrapped)
    mo.fit(settings, data, [monitor], steps, 1, "/tmp/profile_monitor")
    times.sort()
    return times[len(times) // 2] / 1e3, sum(times) / len(times) / 1e3


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    settings = mo.make_settings(mo.parse_args([] if torch.cuda.is_available() else ["--quick"]))
    data = mo.make_dataset(settings)
    variants = [
        ("default", {}, False),
        ("every", {"nvml_host_interval_s": 0}, False),
        ("presync", {"nvml_host_interval_s": 0}, True),
        ("nvml off", {"nvml": False, "nvml_host_interval_s": 0}, False),
        ("host off", {"host": False, "nvml_host_interval_s": 0}, False),
        ("both off", {"nvml": False, "host": False}, False),
    ]
    if "--default-only" in sys.argv:  # the hook times of the default settings, then the profile
        variants = variants[:1]
    for label, kwargs, presync in variants:
        median, mean = run(settings, data, MemoryMonitor(log_every_n_steps=1, **kwargs), presync=presync)
        print(f"{label:9s} hook median {median:8.1f} us  mean {mean:8.1f} us (start and end hooks pooled)")
    prof = cProfile.Profile()
    run(settings, data, MemoryMonitor(log_every_n_steps=1, nvml_host_interval_s=0), prof)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    print(out.getvalue())


if __name__ == "__main__":
    main()
