"""The Celery wire format between the publisher (service/ledger/dispatch.py), the gpu/cpu workers' consumers
(workers/worker.py, workers/broker.py) and beat (workers/celery_app.py, workers/beat.py). Flask- and torch-free.

An inference message is a Celery protocol-2 message for the task TASK with one argument, the job id:
body `([job_id], {}, embed)`, JSON; header `fair` (service/ledger/fair.py meta) names its tenant, weight, deadline
and estimated tokens for the broker's fair take. Consumers take the broker's transport options from transport_options().
"""
import base64
import os
import socket
import uuid

from celery import Celery
from kombu.utils.json import dumps as kombu_dumps

TASK = "tidepool.run_job"
_ORIGIN = f"{os.getpid()}@{socket.gethostname()}"
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


# The web's publisher does not retry: a broker outage leaves jobs undispatched, for the sweeper to republish.
PUBLISHER = {"task_publish_retry": False, "broker_connection_timeout": 2, "broker_connection_retry": False}


def make_celery(broker_url: str, name: str = "tidepool.service", publisher: bool = True, **conf) -> Celery:
    """The Celery app over `broker_url`, JSON only: the web's publisher (PUBLISHER settings), or with
    publisher=False and `conf` beat's app (workers/celery_app.py)."""
    app = Celery(name, broker=broker_url, set_as_current=False)
    app.conf.update({**(PUBLISHER if publisher else {}), "task_serializer": "json", "accept_content": ["json"],
                     **conf})
    return app


def transport_options(visibility_timeout: float) -> dict:
    # priority: a consumer of several queues drains them in the listed order (strict class order). Every message
    # has priority 0 (the class is the queue), so each queue is one list, not kombu's four (one RPOP per take).
    return {"visibility_timeout": visibility_timeout, "queue_order_strategy": "priority", "priority_steps": [0]}


def _headers(task_id: str, job_id: str, fair: list | None = None) -> dict:
    extra = {} if fair is None else {"fair": fair}   # service/ledger/fair.py: who it is for, its deadline
    return {**extra, "lang": "py", "task": TASK, "id": task_id, "shadow": None, "eta": None, "expires": None,
            "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
            "root_id": task_id, "parent_id": None, "argsrepr": repr([job_id]), "kwargsrepr": "{}",
            "origin": _ORIGIN, "ignore_result": False}


def publish_task(producer, job_id: str, queue: str, fair: list | None = None) -> None:
    """One message for `tidepool.run_job(job_id)`, routed straight to `queue`. Equivalent to
    `celery.send_task(TASK, args=[job_id], queue=queue)` at a fraction of the cost, which matters when a
    50,000-line batch is dispatched."""
    task_id = str(uuid.uuid4())
    producer.publish(([job_id], {}, _EMBED), exchange="", routing_key=queue, serializer="json",
                     headers=_headers(task_id, job_id, fair), correlation_id=task_id, reply_to="", retry=False,
                     delivery_mode=2)


def task_message(job_id: str, queue: str, fair: list | None = None, reply_to: str = "") -> str:
    """The exact Redis list entry kombu's Redis transport writes for publish_task(producer, job_id, queue)
    (tests/service compare the two field by field), built without a producer, a channel or a client. reply_to: the
    inbox of the web process waiting on the job (service/ledger/token_stream.py), where its tokens go."""
    task_id = str(uuid.uuid4())
    body = base64.b64encode(kombu_dumps(([job_id], {}, _EMBED)).encode()).decode()
    return kombu_dumps({"body": body, "content-encoding": "utf-8", "content-type": "application/json",
                        "headers": _headers(task_id, job_id, fair),
                        "properties": {"correlation_id": task_id, "reply_to": reply_to, "delivery_mode": 2,
                                       "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
                                       "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())}})


def reply_to(message) -> str | None:
    """The inbox a taken message names for its job's token stream (task_message), None when it names none."""
    return (getattr(message, "properties", None) or {}).get("reply_to") or None


def job_id(message) -> str:
    """The job id a taken message carries (raises on a malformed message)."""
    return message.decode()[0][0]
