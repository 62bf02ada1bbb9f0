"""One engine over a group of devices: the tensor-parallel group on torch.distributed.

Rank 0 is the engine's own process: it schedules, samples and owns the requests. Ranks 1..N-1 are child processes
started the way torch's elastic launcher starts ranks (a fresh interpreter running follower.py, with RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; the engine config on stdin), so no caller needs a
`__main__` guard, and each loads their shard of the model (models/sharding.py) and a KV pool of their
heads, and then follow rank 0: every step rank 0 broadcasts the step's inputs (flat token ids, positions, cache
slots, block tables, the rows that need logits, the adapters' token slots) and every rank runs the same forward, the
sharded layers meeting in their all-reduces. The block manager stays one logical pool: block b is block b on every
rank. KV-block moves (swap, copy-on-write) and LoRA slot fills are broadcast the same way, in the order rank 0 makes
them, and a step cut (LLMEngine._StepCut) is followed layer by layer: with a cut armed, rank 0 tells the others
after each layer whether another step runs there first.

The process group is gloo on CPU hosts and NCCL on GPUs (with a gloo group beside it for the commands), created on
a TCPStore rendezvous (each engine's group its own, so a process may hold several engines). On one x86-64 CPU host the activations' all-reduces and the logits' gather go
through shared memory instead (shm_collectives.py), as vLLM's CPU backend does; gloo carries the commands. Each rank
has its own device: a GPU each, or on a CPU host a disjoint set of the cores, ranks 1.. bound to theirs and rank 0,
whose process other engines and the service's threads share, stepping with as many OpenMP threads as its set has
(openmp.team_size) on the cores the others leave.

Faults: every collective has collective_timeout_s; a rank that dies or hangs makes rank 0's step raise RankFailure
(the worker then exits non-zero and its jobs go back to the queue), and a rank whose parent is gone exits."""
import datetime
import logging
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
import weakref

import torch
import torch.distributed as dist

from tidepool.workers.engine.models.sharding import Shard
from tidepool.workers.engine.shm_collectives import RankFailure, ShmCollectives

log = logging.getLogger(__name__)

RUN, MOVE, LORA, CONTINUE, STOP = 1, 2, 3, 4, 5
HEADER = 16                                     # int64 words: op, payload length, then the op's integers
IDLE = datetime.timedelta(days=365)             # a rank waits this long for rank 0's next step (rank 0 may idle)
RENDEZVOUS_S = 300                              # ranks start (import torch, load their shard) within this
FOLLOWER = "tidepool.workers.engine.follower"   # a rank > 0's entry point (follower_main)


def core_sets(size: int) -> list[list[int]]:
    """This process's CPU cores split into `size` disjoint contiguous sets, the first ones one core larger."""
    cores = sorted(os.sched_getaffinity(0))
    base, extra = divmod(len(cores), size)
    out, start = [], 0
    for rank in range(size):
        n = base + (rank < extra)
        out.append(cores[start:start + n])
        start += n
    return out


def bind_process(cores: list[int]) -> None:
    """Every thread of this process (and the threads it starts later) on `cores`, torch's pool one thread each (a
    rank > 0, whose process is its own)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass                                # a thread that ended meanwhile
    torch.set_num_threads(len(cores))


class Collectives:
    """What a rank's sharded layers and the command channel call: shared memory where it can, else `group` (NCCL or
    gloo) for tensors on the device and `command_group` (gloo, on the CPU) for the commands."""

    def __init__(self, rank: int, size: int, group, timeout_s: float, shm: ShmCollectives | None,
                 command_group=None):
        self.rank, self.size, self.group, self.timeout_s, self.shm = rank, size, group, timeout_s, shm
        self.command_group = command_group or group

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:             # gloo: a peer closed its connection or the timeout passed
            raise RankFailure(f"tensor-parallel collective failed: {exc}") from exc

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        if op == dist.ReduceOp.SUM and self.shm is not None and self.shm.fits(t):
            return self.shm.all_reduce(t)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._wait(self.group.allreduce([t], options))

    def gather_rows(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` on rank 0 (None on the others)."""
        t = t.contiguous()
        if self.shm is not None and self.shm.fits(t):
            return self.shm.gather(t)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [t]))
        return parts if self.rank == 0 else None

    def broadcast_command(self, t: torch.Tensor, fast: bool, timeout: datetime.timedelta | None = None) -> None:
        """Rank 0's CPU tensor `t` into every rank's."""
        if fast and self.shm is not None and self.shm.fits(t):
            return self.shm.broadcast(t)
        group = self.command_group
        self._wait(group.broadcast(t, 0, timeout) if timeout else group.broadcast(t, 0))


class Channel:
    """Rank 0's commands to the other ranks, in order, as CPU tensors over gloo (a GPU group too: a rank waiting for
    the next step then blocks a CPU thread, not a GPU kernel). `fast` (inside a forward: a step cut's layer
    boundary) uses the spinning shared-memory path; between steps the others block in a gloo broadcast that may
    wait for days."""

    def __init__(self, comm: Collectives):
        self.comm = comm

    def send(self, op: int, ints=(), payload: list[int] | None = None, fast: bool = False) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0], header[1] = op, len(payload or ())
        header[2:2 + len(ints)] = torch.tensor(ints, dtype=torch.int64)
        self.comm.broadcast_command(header, fast)
        if payload:
            self.comm.broadcast_command(torch.tensor(payload, dtype=torch.int64), fast)

    def recv(self, fast: bool) -> tuple[int, list[int], torch.Tensor | None]:
        header = torch.zeros(HEADER, dtype=torch.int64)
        self.comm.broadcast_command(header, fast, None if fast else IDLE)
        header = header.tolist()
        payload = None
        if header[1]:
            payload = torch.empty(header[1], dtype=torch.int64)
            self.comm.broadcast_command(payload, fast)
        return header[0], header[2:], payload


def _device(config, rank: int) -> torch.device:
    device = torch.device(config.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _process_group(store, rank: int, size: int, device: torch.device, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("tidepool-tp-nccl", store), rank, size, options)
    return dist.ProcessGroupGloo(dist.PrefixStore("tidepool-tp", store), rank, size, timeout)


def _groups(store, rank: int, size: int, device: torch.device, timeout_s: float) -> tuple:
    """(the tensors' group, the commands' group): one gloo group on a CPU host; NCCL and gloo on GPUs."""
    group = _process_group(store, rank, size, device, timeout_s)
    if device.type != "cuda":
        return group, group
    return group, _process_group(store, rank, size, torch.device("cpu"), timeout_s)


def shm_capacity(config) -> int:
    """Bytes a shared-memory slot holds: a full step's activations, or the logits of up to max_num_seqs rows (at
    most 128) of one rank's vocabulary rows, whichever is larger; larger tensors take gloo."""
    m = config.model_config
    element = torch.tensor([], dtype=config.torch_dtype).element_size()
    activations = config.max_num_batched_tokens * m.hidden_size * element
    logits = min(config.max_num_seqs, 128) * -(-m.vocab_size // config.tensor_parallel_size) * 4
    return max(activations, logits, 4096)


class TensorParallelGroup:
    """Rank 0's side of the group: starts the other ranks, holds the collectives and the command channel."""

    def __init__(self, config):
        self.size = config.tensor_parallel_size
        self.timeout_s = config.collective_timeout_s
        device = _device(config, 0)
        cores = core_sets(self.size) if device.type == "cpu" else [sorted(os.sched_getaffinity(0))] * self.size
        store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=datetime.timedelta(seconds=RENDEZVOUS_S),
                              wait_for_workers=False)
        shm, shm_file = None, None
        if device.type == "cpu" and platform.machine() in ("x86_64", "AMD64"):
            shm_file = tempfile.NamedTemporaryFile(prefix="tidepool-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                   else None)
            shm = ShmCollectives.allocate(self.size, shm_capacity(config), shm_file.name)
        started = time.perf_counter()
        self.procs = []
        for rank in range(1, self.size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
            proc = subprocess.Popen([sys.executable, "-c", f"from {FOLLOWER} import follower_main; follower_main()"],
                                    stdin=subprocess.PIPE, env=env)
            proc.stdin.write(pickle.dumps((config, cores[rank], shm_file and shm_file.name, shm_capacity(config),
                                           os.getpid())))
            proc.stdin.close()
            self.procs.append(proc)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.threads = len(cores[0])     # rank 0 steps with this many OpenMP threads (ModelRunner.run)
        group, commands = _groups(store, 0, self.size, device, self.timeout_s)
        self.store, self.shm_file = store, shm_file      # the file goes when the group does
        self.comm = Collectives(0, self.size, group, self.timeout_s,
                                shm and ShmCollectives(0, self.size, *shm, self.timeout_s, self.alive), commands)
        self.channel = Channel(self.comm)
        self.shard = Shard(0, self.size, self.comm)
        self.closed = False
        log.info("tensor-parallel group of %d ranks up in %.1f s (%s%s; rank 0 on %s)", self.size,
                 time.perf_counter() - started, "nccl" if device.type == "cuda" else "gloo",
                 ", shared-memory all-reduce" if shm else "",
                 f"{self.threads} thread(s), ranks 1.. on cores {cores[1:]}" if device.type == "cpu" else device)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def check(self) -> None:
        """Raise RankFailure when a rank has exited."""
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise RankFailure(f"tensor-parallel rank {rank} exited (code {p.returncode})")

    def close(self) -> None:
        """Stop the other ranks (a STOP command; those that do not end in a few seconds are killed)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.alive():
                self.channel.send(STOP)
        except Exception:  # noqa: BLE001 - a broken group is torn down below all the same
            pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.shm_file is not None:
            self.shm_file.close()


def start_group(config, owner) -> TensorParallelGroup:
    """Start the group for `owner` (rank 0's ModelRunner); it is closed when the owner is collected."""
    group = TensorParallelGroup(config)
    weakref.finalize(owner, group.close)
    return group
