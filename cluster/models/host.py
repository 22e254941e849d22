"""How a process that runs models is set up: its torch threads, and a host allocator that keeps what it frees.

Torch has no caching allocator for CPU tensors (its CUDA allocator keeps freed blocks for the next tensor), so a
CPU tensor's memory comes from the C library's ``malloc``.  glibc serves a block of 32 MiB or more (less, for a
thread's own arena) by a fresh ``mmap`` and unmaps it on free, and trims its heaps' free tops: the next tensor of
that size faults in fresh zeroed pages.  At a production vocabulary a step's V-wide tensors are that large (a
verification round's ``[32, 5, 128256]`` float32 probabilities: 82 MB), and on a virtual machine the page faults
can cost several times the work itself (a softmax into fresh memory against one into memory used before).
So a model process keeps its freed memory, as the CUDA caching allocator does: one arena for every thread (a
thread's own arena cannot hold a block above 64 MiB), no ``mmap``, no trimming.  Its resident size then stays at
its peak.  The settings go into the environment too, so that processes started from this one (Ray's workers of a
local cluster) start with them; a setting already in the environment is the operator's and stays.  Elsewhere than
glibc nothing changes.
"""
from __future__ import annotations

import ctypes
import os

import torch

# mallopt's parameters (glibc's malloc.h) and the environment variables glibc reads at start for them
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_KEEP = {_M_ARENA_MAX: ("MALLOC_ARENA_MAX", 1), _M_MMAP_MAX: ("MALLOC_MMAP_MAX_", 0),
         _M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", 2 ** 31 - 1)}


def setup_process(threads: int) -> None:
    """Torch intra-op ``threads`` and the allocator that keeps freed memory (:func:`keep_freed_memory`)."""
    torch.set_num_threads(threads)
    keep_freed_memory()


def keep_freed_memory() -> bool:
    """glibc's malloc set to keep what the process frees (module docstring) -> whether it was (False: not glibc)."""
    libc = ctypes.CDLL(None)                    # the process's own symbols (no search for the library on disk)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    for param, (env, value) in _KEEP.items():
        if env in os.environ:                   # the operator's choice: glibc read it when the process started
            continue
        if mallopt(param, value) != 1:
            return False
        os.environ[env] = str(value)
    return True
