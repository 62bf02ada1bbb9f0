"""The SLA classes: the one definition the ledger, the queues, the settings, the API and the panel use."""
import enum


class SlaClass(str, enum.Enum):
    """The SLA classes, highest priority first: the one list the ledger, the queues, the workers' metrics and the
    panel use (the engine keeps the same names for its priority ranks; tests/workers/test_protocol.py checks it)."""
    realtime = "realtime"
    interactive = "interactive"
    batch = "batch"
    deferrable = "deferrable"


SLA_CLASSES = tuple(c.value for c in SlaClass)
ONLINE_CLASSES = (SlaClass.realtime.value, SlaClass.interactive.value)   # answered on /v1/*completions
OFFLINE_CLASSES = (SlaClass.batch.value, SlaClass.deferrable.value)     # batch files; filled into spare capacity
