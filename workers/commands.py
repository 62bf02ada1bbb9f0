"""Engine-side subcommands of the `tidepool` CLI. Imports of torch and the engine stay inside the handlers."""


def register(sub) -> None:
    pass
