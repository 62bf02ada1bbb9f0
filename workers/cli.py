"""The `tidepool` command line. Each area registers its own subcommands; heavy imports stay lazy."""
import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from tidepool.service import commands as service_commands
    from tidepool.workers import engine_commands as worker_commands

    parser = argparse.ArgumentParser(prog="tidepool", description="Tidepool: multi-tenant LLM job service")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    worker_commands.register(sub)
    service_commands.register(sub)
    return parser


def main(argv=None) -> int:
    from tidepool.service.ledger.settings import Config, SettingsError
    from tidepool.service.ledger.logging import configure

    args = build_parser().parse_args(argv)
    try:
        Config.env_values()     # every TIDEPOOL_* variable is checked before any command starts
    except SettingsError as exc:
        print(f"tidepool: {exc}", file=sys.stderr)
        return 2
    configure()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
