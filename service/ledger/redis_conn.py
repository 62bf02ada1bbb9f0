"""The Redis client for TIDEPOOL_REDIS_URL: one server (`redis.Redis`) or a Redis Cluster
(`redis.cluster.RedisCluster`). Flask- and torch-free; every process that talks to Redis gets its client here.

The URL names one node; whether it is a cluster node is asked of it (`INFO cluster`: cluster_enabled:1) when a process
first connects, so the URL of any node of a cluster names the whole cluster (the client learns the others from it),
and the URL of a plain server works as it always did. A cluster cannot be told from its URL alone, and asking costs one
round trip per process; a node that cannot be reached then is not asked again until it answers (the next client asks
anew), and meanwhile counts as one server, which is what it was before clusters. On a cluster the broker's keys carry
a hash tag per queue (service/ledger/cluster_queues.py) and streams use sharded pub/sub (token_stream.py)."""
import threading
from urllib.parse import urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

_known: dict[str, bool] = {}
_nodes: dict[str, list[tuple[str, int]]] = {}     # a cluster's URL -> its nodes, as a client last saw them
_lock = threading.Lock()


def _node(url: str) -> str:
    """The URL without its database number (a cluster has only database 0) or query: the cache's key."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def is_cluster(url: str | None) -> bool:
    """Whether `url` names a Redis Cluster node; False for no URL, memory://, a unix socket, or a node that cannot be
    reached now (asked again next time)."""
    if not url or not url.startswith(("redis://", "rediss://")):
        return False
    key = _node(url)
    known = _known.get(key)
    if known is not None:
        return known
    try:
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            known = int(client.info("cluster").get("cluster_enabled") or 0) == 1
        finally:
            client.close()
    except redis.RedisError:
        return False
    with _lock:
        _known[key] = known
    return known


def client(url: str, **kwargs):
    """A client for `url`: `RedisCluster` when it names a cluster node, else `redis.Redis`. kwargs: the client's
    connection options (socket_timeout, socket_connect_timeout, ...)."""
    if is_cluster(url):
        key = _node(url)
        # the nodes earlier clients of this process learned, so a new client (a worker reconnecting) still finds
        # the cluster when the URL's own node is the one that is down
        known = [ClusterNode(host, port) for host, port in _nodes.get(key, ())]
        cluster = RedisCluster.from_url(key, startup_nodes=known, **kwargs)
        _nodes[key] = [(node.host, node.port) for node in cluster.get_nodes()]
        return cluster
    return redis.Redis.from_url(url, **kwargs)


def on_cluster(client_) -> bool:
    """Whether a client talks to a Redis Cluster."""
    return isinstance(client_, RedisCluster)
