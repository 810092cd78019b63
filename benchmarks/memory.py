"""Peak resident memory of this process, measured from a reset point (Linux /proc).

``getrusage``'s ru_maxrss is no good here: Linux carries it across fork and exec,
so a child inherits its parent's peak. ``VmHWM`` belongs to the address space,
and writing 5 to ``/proc/self/clear_refs`` resets it to the current RSS.
"""

from __future__ import annotations


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    return _status_kb("VmHWM") * 1024
