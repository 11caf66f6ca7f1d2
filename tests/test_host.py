"""host.py: the one process-memory action it holds, release_free_heap."""
import ctypes
import platform
import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes
from tokenmill.host import release_free_heap

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


# 2000 blocks of 64 KiB (under glibc's mmap threshold: they come from the heap), touched; then all but the last
# freed: the live block on top keeps the heap from shrinking by itself, as a start's long-lived objects do
blocks = [libc.malloc(64 << 10) for _ in range(2000)]
for b in blocks:
    libc.memset(b, 1, 64 << 10)
for b in blocks[:-1]:
    libc.free(b)
before = rss_mib()
released = release_free_heap()
print(before, rss_mib(), released)
"""


@pytest.mark.skipif(platform.system() != "Linux" or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="malloc_trim is glibc's")
def test_release_free_heap_hands_freed_pages_back():
    """~125 MiB freed below a live block stay resident until release_free_heap (malloc_trim), which hands them
    back: what a start does after its tokenizer load, a GGUF's first conversion and the kernel probes."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
    before, after, released = out.stdout.split()
    assert released == "True"
    assert float(before) - float(after) > 100, out.stdout
