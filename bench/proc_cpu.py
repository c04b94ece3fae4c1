"""CPU time of a whole process tree: a service is its main process plus every child it started.

The engine service steps its model in a child process (and multiprocessing adds a resource tracker); worker
processes of a front are children too. Sampling only the main process would miss most of the work.
"""

from dataclasses import dataclass

import psutil


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and all its live descendants, plus their reaped children's.

    NOTE: a process that exits between two samples and is not reaped by its parent loses its time; the
    services' processes live for the whole load phase, so the delta of two samples is exact for them.
    """
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def largest_descendant(pid: int) -> int | None:
    """The descendant of `pid` with the most resident memory (the engine service's engine-core process, which
    holds the model and the KV cache), or None when it has none."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    sizes = {}
    for child in children:
        try:
            sizes[child.pid] = child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return max(sizes, key=sizes.get) if sizes else None


@dataclass(slots=True)
class CpuMeter:
    """CPU seconds each named process tree spent between start() and stop()."""

    pids: dict[str, int]
    started: dict[str, float] | None = None

    def start(self) -> None:
        self.started = {name: tree_cpu_s(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        if self.started is None:
            raise RuntimeError("CpuMeter.stop() before start()")
        return {name: tree_cpu_s(pid) - self.started[name] for name, pid in self.pids.items()}
