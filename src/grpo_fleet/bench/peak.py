"""One call's wall time and peak resident memory, measured in a fresh process so the peak is that call's alone.

The child imports the function and the modules named (what the call needs loaded anyway), notes its resident
peak as the baseline, then makes the call (or not, for the baseline run) and prints both as JSON. On Linux the
peak is /proc/self/status's VmHWM: ru_maxrss would start at the parent's own peak, which a child inherits
through fork and keeps across exec, so a bench process that had loaded a model reported that model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Optional

_CHILD = r"""
import importlib, json, resource, sys, time
module, function = sys.argv[1].split(":")
call = getattr(importlib.import_module(module), function)
for name in sys.argv[2].split(","):
    importlib.import_module(name)
def peak():
    # Linux: this process image's own high-water mark (ru_maxrss keeps the parent's peak across fork and exec).
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # macOS: bytes, of this process alone
before = peak()
start = time.perf_counter()
if sys.argv[3] != "-":
    call(**json.loads(sys.argv[3]))
print(json.dumps({"seconds": time.perf_counter() - start, "loaded_bytes": before, "peak_bytes": peak()}))
"""


def measured(target: str, preload: list[str], kwargs: Optional[dict[str, Any]]) -> dict[str, float]:
    """Run `target` ("module:function") with `kwargs` in a fresh process (None: load only, the baseline); returns
    seconds, loaded_bytes (the peak before the call) and peak_bytes."""
    argument = "-" if kwargs is None else json.dumps(kwargs)
    done = subprocess.run([sys.executable, "-c", _CHILD, target, ",".join(preload), argument],
                          capture_output=True, text=True, timeout=1800, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
