"""Service subcommands of the `tidepool` CLI (ledger, tenants, keys, web). Never imports torch."""


def register(sub) -> None:
    pass
