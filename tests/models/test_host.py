"""The model processes' set-up (cluster/models/host.py): a freed large tensor's memory stays in the process."""
import json
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, sys, threading, torch
from cluster.models.host import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "on" else False

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
out = {}
def step():                     # a thread of its own, as the serving unit's step loop
    x = torch.ones(96 * 2 ** 20 // 4)          # 96 MiB: above any mmap threshold and a thread arena's heap
    del x
    info = libc.mallinfo2()
    out.update(kept=kept, free=info.fordblks, mapped=info.hblkhd)
t = threading.Thread(target=step); t.start(); t.join()
print(json.dumps(out))
"""


def _probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "."})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_freed_large_tensor_stays_in_the_process():
    try:
        import ctypes
        ctypes.CDLL(None).mallinfo2
    except AttributeError:
        pytest.skip("not glibc (or older than 2.33): the allocator is left as it is")
    off, on = _probe("off"), _probe("on")
    assert on["kept"] and not off["kept"]
    assert on["free"] >= 96 * 2 ** 20 > off["free"]      # kept for the next tensor, or handed back to the kernel
