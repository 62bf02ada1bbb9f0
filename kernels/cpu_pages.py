"""Large CPU tensors on transparent huge pages (Linux), for memory read in scattered blocks: the paged KV cache.

Decode attention reads each sequence's cache blocks (a few KiB each, scattered over a pool of hundreds of MiB) once
per layer and step. On 4 KiB pages nearly every block costs TLB misses, and a page walk is dear under a hypervisor
(nested paging); the hardware prefetcher also stops at each 4 KiB boundary. `empty_on_huge_pages` places the tensor
on 2 MiB-aligned memory advised MADV_HUGEPAGE, so the kernel backs it with 2 MiB pages as it is first touched (with
/sys/kernel/mm/transparent_hugepage/enabled at "madvise" or "always"; at "never" the advice is a no-op). Pages are
still touched lazily: an untouched pool costs no memory, a touched one at most 2 MiB more than on small pages.
Anything that fails (not Linux, no libc, madvise refused) leaves a plain torch.empty tensor: the advice only changes
speed, never contents.
"""
import ctypes
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14      # linux/mman-common.h
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def empty_on_huge_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) on the CPU, contiguous, starting on a 2 MiB boundary and advised onto huge
    pages when that is possible; small tensors (under one huge page) are plain torch.empty."""
    plain = torch.empty(0, dtype=dtype)
    nbytes = plain.element_size() * int(torch.Size(shape).numel())
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE      # whole huge pages, so the tail is covered too
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    tensor = raw[skip:skip + nbytes].view(dtype).view(shape)
    try:
        if _madvise()(raw.data_ptr() + skip, span, MADV_HUGEPAGE) != 0:
            log.info("madvise(MADV_HUGEPAGE) refused (errno %d): the KV pool stays on small pages", ctypes.get_errno())
    except (OSError, AttributeError) as e:
        log.info("no madvise (%s): the KV pool stays on small pages", e)
    return tensor


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages now (None where Linux does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
