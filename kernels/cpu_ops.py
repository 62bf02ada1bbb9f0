"""Native CPU kernels (kernels/csrc/*.cpp, one library), compiled on first use with the system C++ compiler and cached.

`paged_decode_op()` returns torch.ops.tidepool_cpu.paged_decode (decode attention that reads the paged KV cache
in place, same contract as kernels/paged_attention.py), or None, in which case callers use the pure-torch path;
`native_op(name)` does the same for the fused element-wise ops of kernels/layer_ops.py (fused_cpu.cpp) and the
LoRA rows op of kernels/lora_ops.py (lora_cpu.cpp).
They are None (a build or load failure is logged once, as a warning; see unavailable_reason()) when:

* they are switched off: configure(enabled=False), which the engine calls with its config's `cpu_kernels` (the
  TIDEPOOL_CPU_KERNELS setting; the switch for A/B runs and for ruling the kernel out),
* there is no C++ compiler ($CXX, else c++ / g++ / clang++ on PATH),
* the build fails (with -march=native, then without; a flag set that fails to compile is remembered in the cache
  and not tried again), or a built op disagrees with its torch path on a small self-check.

The build is a single g++ call against torch's own headers and libraries (no ninja, no Python headers): about
20-50 s of one core, once per source/torch/compiler/CPU combination (the sources: every .cpp and .h in csrc/). The
shared object is cached under configure(cache_dir=...) (TIDEPOOL_KERNEL_CACHE), else $XDG_CACHE_HOME/tidepool/kernels,
else ~/.cache/tidepool/kernels, named by a hash of all of those, and written atomically; processes that need it at
once take turns on a lock beside it, so one compiles and the others load its file. prepare(background=True), which
the engine calls at start, loads a cached library at once and otherwise builds it on a thread (the compiler niced)
while the ops return None, so the torch path serves until the library is ready; paged_decode_op() (wait=True) waits
for such a build.
"""
import atexit
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_decode_cpu.cpp", "fused_cpu.cpp", "lora_cpu.cpp")]     # compiled into one library
BUILD_TIMEOUT_S = 600
_lock = threading.Lock()
_op = None
_tried = False
_why_not: str | None = None
_building: threading.Thread | None = None     # a build on a thread (prepare(background=True)) until it is done
_compiling: dict | None = {}                  # compiler processes running -> their output file (None: exiting)
_compilers_lock = threading.Lock()
_enabled = True
_cache_dir: Path | None = None


def configure(enabled: bool | None = None, cache_dir: str | os.PathLike | None = None) -> None:
    """The process-wide switch and build folder of the native kernels (the engine passes its config's
    `cpu_kernels` and `kernel_cache`, which the workers take from the settings); None leaves one as it is."""
    global _enabled, _cache_dir
    if enabled is not None:
        _enabled = bool(enabled)
    if cache_dir is not None:
        _cache_dir = Path(cache_dir)


def enabled() -> bool:
    return _enabled


def cache_dir() -> Path:
    """Where built kernels are kept; a per-user temp folder when the usual one cannot be created."""
    if _cache_dir is not None:
        return _cache_dir
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    folder = Path(base) / "tidepool" / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    except OSError:
        return Path(tempfile.gettempdir()) / f"tidepool-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"


def compiler() -> str | None:
    for name in [os.environ.get("CXX")] + ["c++", "g++", "clang++"]:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    # -march=native code is only good on the CPU it was built for: the cache key carries the CPU's features
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _flag_sets(cxx: str) -> list[list[str]]:
    torch_dir = Path(torch.__file__).resolve().parent
    lib = torch_dir / "lib"
    base = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    link = [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    return [base + ["-march=native"] + link, base + link]   # the second for compilers without -march=native


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _source_digest(folder: Path) -> bytes:
    """What the library is built from: every source and header in csrc/, by name and content (a header the sources
    include, such as simd.h, changes the build as much as a source does)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def _build(cxx: str, cached_only: bool = False, nice: int = 0) -> Path | None:
    """The library for this combination: the cached one, else built now (`nice`: the compiler's niceness), else
    RuntimeError; with cached_only, None where it would have to be built."""
    source = _source_digest(CSRC)
    version = _compiler_version(cxx)
    errors = []
    for flags in _flag_sets(cxx):
        key = hashlib.sha256(b"\0".join(s.encode() if isinstance(s, str) else s for s in [
            source, torch.__version__, str(torch.version.git_version), sys.version, cxx, version,
            platform.machine(), _cpu_signature(), " ".join(flags)])).hexdigest()[:20]
        target = cache_dir() / f"paged_decode_cpu-{key}.so"
        failed = target.with_suffix(".failed")     # this flag set failed here before: don't pay for it again
        if target.is_file():
            return target
        if failed.is_file():
            errors.append(failed.read_text(errors="replace"))
            continue
        if cached_only:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(target):      # several processes starting at once: one compiles, the others wait for it
            if target.is_file():
                return target
            if failed.is_file():
                errors.append(failed.read_text(errors="replace"))
                continue
            tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            start = time.perf_counter()
            try:
                done = _compile([cxx, *map(str, SOURCES), "-o", str(tmp)] + flags, tmp, nice)
                if done.returncode == 0:
                    os.replace(tmp, target)
                    log.info("built %s in %.1f s", target, time.perf_counter() - start)
                    return target
                errors.append(done.stderr.strip()[-2000:])
                if done.returncode > 0:     # a compile error, not a kill
                    failed.write_text(errors[-1])
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(str(e))
            finally:
                tmp.unlink(missing_ok=True)
    raise RuntimeError("compile failed:\n" + "\n---\n".join(errors))


@contextmanager
def _build_lock(target: Path):
    """An exclusive lock beside `target` for its build, held until the build ends (the kernel drops it with the
    process, so a killed builder never blocks the next one). Threads of one process also queue on it: flock locks
    belong to the open file, and each call opens its own."""
    with open(target.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(cmd: list[str], tmp: Path, nice: int) -> subprocess.CompletedProcess:
    """Run the compiler; one still running when the process exits (a background build) is killed then, and its
    partial output removed, rather than left to finish for nobody."""
    with _compilers_lock:
        if _compiling is None:
            raise RuntimeError("the process is exiting")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
        _compiling[proc] = tmp
    try:
        out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise
    finally:
        with _compilers_lock:
            if _compiling is not None:
                _compiling.pop(proc, None)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@atexit.register
def _stop_compilers() -> None:
    global _compiling
    with _compilers_lock:
        running, _compiling = _compiling or {}, None       # and none starts from now on
    for proc, tmp in running.items():
        proc.kill()
        proc.wait()
        tmp.unlink(missing_ok=True)


def _self_check(op) -> None:
    """The built op against the torch path on a small paged batch: GQA, context 1, block edges, -1 padding."""
    from tidepool.kernels.kv_quant import quantize
    from tidepool.kernels.paged_attention import paged_decode_ref
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, group = 4, 2, 3
    contexts = [1, 3, 4, 5, 9]
    for dim in (64, 24):    # a specialised head_dim and the generic path
        k_cache = torch.randn(16, block_size, num_kv_heads, dim, generator=gen)
        v_cache = torch.randn(16, block_size, num_kv_heads, dim, generator=gen)
        tables = torch.full((len(contexts), 4), -1, dtype=torch.int32)
        ids = torch.randperm(16, generator=gen).tolist()
        for b, c in enumerate(contexts):
            n = -(-c // block_size)
            tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
        q = torch.randn(len(contexts), num_kv_heads * group, dim, generator=gen)
        lens = torch.tensor(contexts, dtype=torch.int32)
        got = op(q, k_cache, v_cache, tables, lens, 0.3)
        want = paged_decode_ref(q, k_cache, v_cache, tables, lens, 0.3)
        err = (got - want).abs().max().item()
        if not err <= 1e-4:
            raise RuntimeError(f"self-check: max abs err {err} against the torch path (head_dim {dim})")
        for dtype in (torch.float8_e4m3fn, torch.int8):     # a quantized cache: codes widened in the kernel
            k_scale = torch.rand(num_kv_heads, dim, generator=gen) + 0.01     # per (KV head, channel)
            v_scale = torch.rand(num_kv_heads, dim, generator=gen) + 0.01
            kq, vq = quantize(k_cache, k_scale, dtype), quantize(v_cache, v_scale, dtype)
            got = op(q, kq, vq, tables, lens, 0.3, k_scale, v_scale)
            want = paged_decode_ref(q, kq, vq, tables, lens, 0.3, k_scale, v_scale)
            err = (got - want).abs().max().item()
            if not err <= 1e-4:
                raise RuntimeError(f"self-check: max abs err {err} against the torch path ({dtype}, head_dim {dim})")


def _loaded() -> bool:
    return hasattr(torch.ops.tidepool_cpu, "paged_decode")     # a library loaded earlier in this process


def paged_decode_op(wait: bool = True):
    """torch.ops.tidepool_cpu.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale), or None.
    Loaded (or built) on first use; while prepare(background=True)'s build runs, it waits for it, or with
    wait=False returns None at once (the engine's steps: the torch path serves meanwhile)."""
    if _tried:
        return _op if enabled() else None
    building = _building
    if building is not None:
        if not wait:
            return None
        building.join()
        return _op if enabled() else None
    return _load()


def _load(nice: int = 0):
    global _op, _tried, _why_not
    with _lock:
        if _tried:
            return _op if enabled() else None
        try:
            if not enabled():
                _why_not = "switched off (TIDEPOOL_CPU_KERNELS=0)"
                return None     # not marked tried: enabling it later in the process still builds
            if _loaded():
                _op = torch.ops.tidepool_cpu.paged_decode
            else:
                cxx = compiler()
                if cxx is None:
                    raise RuntimeError("no C++ compiler ($CXX, c++, g++, clang++)")
                torch.ops.load_library(str(_build(cxx, nice=nice)))
                _op = torch.ops.tidepool_cpu.paged_decode
            _self_check(_op)
        except Exception as e:  # noqa: BLE001 - any failure means the torch path
            _op, _why_not = None, f"{type(e).__name__}: {e}"
            log.warning("native CPU paged decode unavailable, using the torch path: %s", _why_not)
        _tried = True
        return _op


def prepare(background: bool = False) -> str:
    """Get the library ready before the first request: `ready` (loaded: from the cache it takes a moment),
    `unavailable` (switched off, no compiler, a failed build: the torch path), or, with background=True where it is
    not built yet, `building`: the build runs on a thread with the compiler niced, the ops are None until it is
    done (then the `native CPU decode kernel ready` line), and nothing waits for it."""
    global _building
    if not enabled():
        return "unavailable"
    if background and not _tried and _building is None:
        with _lock:
            cxx = None if _tried or _building is not None or _loaded() else compiler()
            if cxx is not None and _build(cxx, cached_only=True) is None:
                _building = threading.Thread(target=_build_in_background, name="tidepool-kernel-build", daemon=True)
                _building.start()
    if not _tried and _building is not None:
        return "building"
    return "ready" if paged_decode_op() is not None else "unavailable"


def _build_in_background() -> None:
    started = time.perf_counter()
    if _load(nice=10) is not None:
        log.info("native CPU decode kernel ready: built in the background in %.1f s; decode uses it from now on",
                 time.perf_counter() - started)


class CheckedOnce:
    """A native op's self-check against its torch reference, run once per process (thread-safe): ok() is its
    verdict; a failure is logged once and the torch path serves from then on."""

    def __init__(self, check, what: str):
        self._check, self._what, self._ok, self._lock = check, what, None, threading.Lock()

    def ok(self) -> bool:
        if self._ok is None:
            with self._lock:
                if self._ok is None:
                    try:
                        self._check()
                        self._ok = True
                    except Exception as e:  # noqa: BLE001 - any failure means the torch path
                        log.warning("%s unavailable, using the torch path: %s", self._what, e)
                        self._ok = False
        return self._ok


def native_op(name: str):
    """torch.ops.tidepool_cpu.<name> when the native library is built, loaded and self-checked, else None (also
    while a background build runs)."""
    return getattr(torch.ops.tidepool_cpu, name) if paged_decode_op(wait=False) is not None else None


def unavailable_reason() -> str | None:
    """Why paged_decode_op() returned None (None when it did not, or was not asked yet)."""
    return _why_not
