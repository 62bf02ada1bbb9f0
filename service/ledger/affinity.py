"""Prefix-affinity routing (Flask- and torch-free; the web's publisher and the workers both import it).

Requests that share a long prefix (a batch's system prompt, a chat's history) should run on the worker that
already holds that prefix in its KV cache, as llm-d and Dynamo route by KV locality. The pieces:

- `prefix_key(namespace, endpoint, body)`: a stable key (blake2b, the same in every process, unlike
  Python's hash()) of the first PREFIX_CHARS characters of a request's prompt as the ledger stores it, within
  its prefix-cache namespace (service.ledger.models.cache_namespace). The web never tokenizes, so the key is over
  text: two requests with the same key share (nearly) the same first ~PREFIX_CHARS/4 prompt tokens. Prompts
  shorter than that get no key: their prefix is too short to be worth a queue of its own.
- Workers remember the keys of the jobs they claimed (`PrefixMemory`, most recent first, bounded) and
  advertise the newest ADVERTISED of them with their heartbeat (`prefixes`), with their load (`inflight`,
  `private_backlog`, `seats`). This approximates their KV cache from what they ran, as llm-d's approximate
  prefix scorer does, without reaching into the engine.
- Each worker also consumes a private queue per class, `private_queue(queue, worker)`, before the shared
  one. The publisher (`Router.route`) sends a keyed request to the private queue of the live worker holding
  its key (or, for a key nobody holds yet, of the least-loaded worker, remembered so the rest of its group
  follows), unless that worker is more than its `seats` ahead of the least-loaded worker: then it goes to the
  shared class queue, where any worker takes it. No key, no live workers, one worker: the shared queue.
- Crash safety is the shared queue's: messages are taken into the unacked set, acked late, restored to the
  queue they came from; a worker that stops moves what is left in its private queues to the shared ones
  (workers/worker_affinity.py), and beat moves the private queues of workers whose heartbeat is gone
  (`drain_dead`). A message routed to a worker that just died waits there at most one heartbeat TTL plus one
  sweep; the ledger's guarded claim keeps every job to one completion whatever queue it comes from.
"""
import hashlib
import json
import threading
import time
from collections import OrderedDict

from . import fair
from .models import cache_namespace
from ..protocol import CHAT
from .snapshots import HEARTBEAT_KEY

SEP = ">"                                # private queue = "<shared queue>><worker name>" (queue names use "@")
PREFIX_CHARS = 512                       # characters of prompt text a key covers (~128 tokens and more)
ADVERTISED = 64                          # keys a heartbeat carries, newest first
REMEMBERED = 4096                        # keys a publisher remembers having placed itself
REFRESH = 1.0                            # seconds a publisher reuses the heartbeats it read



def private_queue(queue: str, worker: str) -> str:
    """The queue only `worker` consumes, for messages of the shared queue `queue`."""
    return f"{queue}{SEP}{worker}"


def split_private(name: str) -> tuple[str, str] | None:
    """(shared queue, worker) of a private queue name; None for a shared one."""
    queue, sep, worker = name.rpartition(SEP)
    return (queue, worker) if sep and queue and worker else None


def prefix_text(endpoint: str, body: dict) -> str:
    """The start of a request's prompt as canonical text: a completion's prompt, or a chat's tools and messages
    (role and text of each, in order), which is what its rendered prompt begins with."""
    if endpoint == CHAT:
        parts = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
        for m in body.get("messages") or []:
            content = m.get("content")
            if not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
            parts.append(f"{m.get('role')}\x1f{content}")
            if sum(map(len, parts)) >= PREFIX_CHARS:
                break
        return "\x1e".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):   # token ids
        return ",".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


def prefix_key(namespace: str | None, endpoint: str, body: dict, chars: int = PREFIX_CHARS) -> str | None:
    """Stable key of a request's first `chars` prompt characters within its cache namespace; None if shorter."""
    if namespace is None or not isinstance(body, dict):
        return None
    try:
        text = prefix_text(endpoint, body)
    except (KeyError, TypeError, AttributeError):
        return None
    if len(text) < chars:
        return None
    data = f"{namespace}\x00{endpoint}\x00{text[:chars]}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=10).hexdigest()


def job_prefix_key(tenant_id: str, prefix_cache_group: str | None, endpoint: str, body: dict) -> str | None:
    """prefix_key of a ledger job (its tenant's cache namespace, endpoint, normalised request body): what the
    web publishes it with and what the worker that claims it remembers."""
    return prefix_key(cache_namespace(tenant_id, prefix_cache_group), endpoint, body)


class PrefixMemory:
    """A worker's keys of the jobs it claimed, most recent last, at most `size` of them."""

    def __init__(self, size: int = 1024):
        self.size, self.keys = size, OrderedDict()
        self.lock = threading.Lock()

    def add(self, key: str | None) -> None:
        if key is None:
            return
        with self.lock:
            self.keys[key] = None
            self.keys.move_to_end(key)
            while len(self.keys) > self.size:
                self.keys.popitem(last=False)

    def newest(self, n: int = ADVERTISED) -> list[str]:
        with self.lock:
            keys = list(self.keys)
        return keys[::-1][:n]


# Moves a private queue (KEYS[1]) to the consuming end of its shared queue (KEYS[2]), its oldest message to be taken
# first: consumers RPOP, so the private list is popped from its newest (left) end and appended on the right, its
# oldest message ending rightmost. Returns how many moved.
_MOVE = """
local n = 0
while true do
  local raw = redis.call('LPOP', KEYS[1])
  if not raw then return n end
  redis.call('RPUSH', KEYS[2], raw)
  n = n + 1
end
"""


def _same(name: str) -> str:
    return name


# key, lane: a queue's Redis key from its name and back; the name itself on one Redis server, the name under its hash
# tag on a Redis Cluster (service/ledger/cluster_queues.py list_key and lane_of).
def move_private(client, name: str, key=_same) -> int:
    """Hand the messages waiting in private queue `name` (its list, and what the fair take sorted in) to its shared
    queue, each in one atomic step."""
    parts = split_private(name)
    if parts is None:
        return 0
    src, dst = key(name), key(parts[0])
    return int(fair.run_script(client, _MOVE, 2, src, dst) or 0) + fair.move_lane(client, src, dst)


def private_depths(client, lane=_same) -> dict[str, int]:
    """Messages waiting in each private queue (name -> depth); the queue's shared name is split_private's."""
    depths = {}
    for raw in client.scan_iter(match=f"*{SEP}*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        if split_private(lane(key)) is not None:
            depth = client.llen(key) if client.type(key) in (b"list", "list") else 0
            if depth:
                depths[lane(key)] = int(depth)
    return depths     # (what the fair take sorted in from them: fair.lane_backlogs)


def drain_dead(client, key=_same, lane=_same) -> int:
    """Beat: move the private queues of workers without a live heartbeat to their shared queues."""
    moved = 0
    alive: dict[str, bool] = {}
    names = set()
    for raw in client.scan_iter(match=f"*{SEP}*", count=1000):
        name = raw.decode() if isinstance(raw, bytes) else raw
        if name.startswith(fair.PREFIX + "b:"):     # a private lane's fair backlog
            names.add(lane(name[len(fair.PREFIX) + 2:]))
        elif client.type(name) in (b"list", "list"):
            names.add(lane(name))
    for name in sorted(names):
        parts = split_private(name)
        if parts is None:
            continue
        worker = parts[1]
        if worker not in alive:
            alive[worker] = bool(client.exists(HEARTBEAT_KEY.format(worker)))
        if not alive[worker]:
            moved += move_private(client, name, key)
    return moved


class Router:
    """The publisher's choice of queue for a keyed request (see the module docstring). Thread-safe; one per
    dispatcher. It reads the heartbeats at most every REFRESH seconds and counts what it routed since."""

    def __init__(self, client, refresh: float = REFRESH, clock=time.monotonic):
        self.client, self.refresh, self.clock = client, refresh, clock
        self.lock = threading.Lock()
        self.workers: dict[str, dict] = {}      # name -> heartbeat
        self.held: dict[str, set] = {}          # name -> advertised keys
        self.routed: dict[str, int] = {}        # name -> messages routed to it since its last heartbeat read
        self.placed: OrderedDict = OrderedDict()    # key -> worker this router placed it on
        self.groups: dict[str, int] = {}        # name -> keys in `placed` that are on it
        self.read_at = float("-inf")
        self.counts = {"private": 0, "shared": 0, "overflow": 0}

    def _read(self) -> None:
        keys = list(self.client.scan_iter(match=HEARTBEAT_KEY.format("*"), count=1000))
        mget = getattr(self.client, "mget_nonatomic", self.client.mget)     # (a cluster's keys are on several slots)
        beats = mget(keys) if keys else []
        workers = {}
        for raw in beats:
            if not raw:
                continue
            try:
                beat = json.loads(raw)
            except ValueError:
                continue
            workers[beat.get("name")] = beat
        for name, beat in workers.items():
            old = self.workers.get(name)
            if old is None or old.get("at") != beat.get("at"):
                self.routed[name] = 0           # its backlog in the new heartbeat covers what was routed
        self.workers = workers
        self.held = {name: set(beat.get("prefixes") or ()) for name, beat in workers.items()}
        self.read_at = self.clock()

    def _place(self, key: str, name: str) -> None:
        old = self.placed.get(key)
        if old != name:
            if old is not None:
                self.groups[old] -= 1
            self.groups[name] = self.groups.get(name, 0) + 1
        self.placed[key] = name
        self.placed.move_to_end(key)
        while len(self.placed) > REMEMBERED:
            _, gone = self.placed.popitem(last=False)
            self.groups[gone] -= 1

    def load(self, name: str) -> int:
        beat = self.workers[name]
        return int(beat.get("inflight") or 0) + int(beat.get("private_backlog") or 0) + self.routed.get(name, 0)

    def route(self, queue: str, key: str | None) -> str:
        """The queue to publish a request of shared queue `queue` with prefix key `key` to."""
        if key is None:
            return queue
        with self.lock:
            if self.clock() - self.read_at >= self.refresh:
                try:
                    self._read()
                except Exception:       # Redis trouble: the shared queue, which the publish will also meet
                    self.read_at = self.clock()
                    self.workers = {}
            eligible = [name for name, beat in self.workers.items() if queue in (beat.get("queues") or ())]
            if len(eligible) < 2:
                self.counts["shared"] += 1
                return queue
            loads = {name: self.load(name) for name in eligible}
            holders = [name for name in eligible if key in self.held.get(name, ())]
            placed = self.placed.get(key)
            if not holders and placed in loads:
                holders = [placed]
            if holders:
                best = min(holders, key=lambda n: (loads[n], n))
            else:
                # Nobody holds it: the worker with the fewest groups placed on it (a group's size is not known
                # yet; in expectation they are equal), then the least loaded, takes it; the rest of the group follows.
                best = min(eligible, key=lambda n: (self.groups.get(n, 0), loads[n],
                                                    hashlib.blake2b(f"{key}{n}".encode()).digest()))
            self._place(key, best)
            seats = max(1, int(self.workers[best].get("seats") or 1))
            if loads[best] - min(loads.values()) >= seats:
                self.counts["overflow"] += 1
                return queue        # it is a full engine's worth ahead of the least-loaded worker
            self.routed[best] = self.routed.get(best, 0) + 1
            self.counts["private"] += 1
            return private_queue(queue, best)
