"""OpenAI's `service_tier` as Tidepool's SLA classes: one request field, one class. `auto` is the tenant's
default class; `default` interactive, `priority` realtime, `flex` the batch class served online."""
from .errors import bad_request

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
