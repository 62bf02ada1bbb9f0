"""The SLA classes: the one definition the ledger, the queues, the settings, the API and the panel use; and OpenAI's
`service_tier` as them (one request field, one class: `auto` is the tenant's default class, `default` interactive,
`priority` realtime, `flex` the batch class served online)."""
import enum

from .errors import bad_request


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

TIER_CLASS = {"default": "interactive", "priority": "realtime", "flex": "batch"}
CLASS_TIER = {"realtime": "priority", "interactive": "default", "batch": "flex", "deferrable": "flex"}
TIERS = ("auto", *TIER_CLASS)


def sla_class(tier, sla, default: str) -> str:
    """The class a request runs in, from its `service_tier` and `sla_class` (either may be None): `sla_class`
    wins when both are given and agree; disagreeing values are a 400."""
    if tier is not None and tier not in TIERS:
        raise bad_request(f"'service_tier' must be one of {list(TIERS)}.", "service_tier")
    if sla is not None and not isinstance(sla, str):
        raise bad_request("'sla_class' must be a string.", "sla_class")
    from_tier = TIER_CLASS.get(tier)     # None for auto (the tenant's default) and for no tier
    if sla is not None and from_tier is not None and sla != from_tier:
        raise bad_request(f"'service_tier' {tier!r} is class '{from_tier}', but 'sla_class' is '{sla}'; give one "
                          "of them, or values that agree.", "service_tier")
    return sla or from_tier or default


def tier(sla: str) -> str:
    """The `service_tier` a response reports for the class it ran in."""
    return CLASS_TIER[getattr(sla, "value", sla)]
