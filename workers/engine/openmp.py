"""The OpenMP thread teams behind PyTorch's CPU kernels.

libgomp (the OpenMP runtime PyTorch's wheels carry) keeps one pool of team threads for every thread that ever ran
a parallel region, until that thread ends. Once the pools hold more threads than the host has CPUs, every idle
team thread of every pool stops spinning between regions and sleeps at once (libgomp's throttled spin count), so
each parallel region of the thread that steps the engine first waits for its team to be woken: on a host with
few cores that wake-up costs more than a small region's work, and a worker's engine is built on one thread and
stepped on another, so without this it would run every step with two pools. The thread that built an engine gives
its team back
(release_team) so that the stepping thread's team is the only one; a later parallel region on the building thread
starts a new team (one thread start), which is what an engine stepped where it was built pays once."""
import ctypes
import functools
import logging

log = logging.getLogger(__name__)
OMP_PAUSE_HARD = 2      # omp_pause_resource_t: end the team's threads (OpenMP 5.0)


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (PyTorch's), found by path in /proc/self/maps once (a device stepper calls
    release_team after every step); None without one."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def release_team() -> bool:
    """End the calling thread's OpenMP team threads (libgomp's omp_pause_resource_all(omp_pause_hard)). False where
    there is no libgomp or it refused (a call inside a parallel region)."""
    gomp = _libgomp()
    if gomp is None or not hasattr(gomp, "omp_pause_resource_all"):
        return False
    ok = gomp.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
    if not ok:
        log.debug("omp_pause_resource_all refused: the OpenMP team of this thread stays")
    return ok


class team_size:
    """`with team_size(n):` the calling thread's parallel regions use n OpenMP threads (its own nthreads ICV, which
    ATen and oneDNN read through omp_get_max_threads), and what it was after; other threads keep theirs. A
    tensor-parallel rank 0 steps with its share of the cores this way, inside a process other engines share."""

    def __init__(self, n: int):
        self.n, self.before = n, None

    def __enter__(self):
        gomp = _libgomp()
        if gomp is not None and hasattr(gomp, "omp_set_num_threads"):
            self.before = gomp.omp_get_max_threads()
            if self.before != self.n:
                gomp.omp_set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        if self.before is not None and self.before != self.n:
            _libgomp().omp_set_num_threads(self.before)
