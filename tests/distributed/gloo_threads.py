"""The gloo threads still running in this process, for the rank scripts' check that leaving the process
group ended them: a gloo worker still running while the interpreter shuts down can take the GIL there,
which aborts the process (see the first import of train/distributed.py)."""

import os


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``); [] off Linux,
    where /proc/self/task does not list them."""
    if not os.path.isdir("/proc/self/task"):
        return []
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return [name for name in names if "gloo" in name]
