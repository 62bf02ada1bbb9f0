"""The reference pages are generated from the code (docs/gen_reference.py): the configuration table from the
settings object, the CLI from the argument parsers, the HTTP API from the OpenAPI document the service serves, the
metrics from the registered collectors, the admin panel's screenshot list from docs/assets/panel. A committed page
that differs from what the code produces fails, naming the command that regenerates it."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _generator()


@pytest.fixture(scope="module")
def pages(gen):
    return gen.pages()


def test_every_reference_page_is_what_the_code_produces(gen, pages):
    stale = [str(path.relative_to(ROOT)) for path, text in pages.items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"out of date: {', '.join(stale)}: regenerate with `{gen.REGENERATE}` and commit the result"


def test_the_configuration_page_lists_every_setting_with_its_default(pages, gen):
    from tidepool.service.ledger.settings import OTHER_VARIABLES, variables
    page = pages[gen.REFERENCE / "configuration.md"]
    for env, shown, _ in variables() + OTHER_VARIABLES:
        assert f"| `{env}` | {shown} |" in page, env


def test_the_cli_page_has_every_subcommand_and_flag(pages, gen):
    from tidepool.workers.cli import build_parser
    page = pages[gen.REFERENCE / "cli.md"]
    for words, parser, _ in gen._leaves(build_parser(), ["tidepool"]):
        assert f"## `{' '.join(words)}`" in page
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in page, (words, option)


def test_the_http_page_and_document_cover_every_route_of_the_served_spec(pages, gen):
    from tidepool.service.openapi import spec
    page, doc = pages[gen.REFERENCE / "http-api.md"], json.loads(pages[gen.REFERENCE / "openapi.json"])
    served = spec()
    assert doc["paths"].keys() == served["paths"].keys()
    for path, methods in served["paths"].items():
        for method, op in methods.items():
            assert f"### {method.upper()} `{path}` {{#{op['operationId']}}}" in page
    for name in served["components"]["schemas"]:
        assert f"### {name} {{#schema-{name.lower()}}}" in page


def test_the_openapi_copy_is_the_served_document(pages, gen):
    """The committed copy is the document the service serves (built at two clock readings: nothing in it may
    depend on the clock, a deadline's bounds included)."""
    from tidepool.service.protocol import request_bodies as bodies
    from tidepool.service.openapi import spec
    doc = json.loads(pages[gen.REFERENCE / "openapi.json"])
    assert doc == gen.openapi_document() == json.loads(json.dumps(spec()))
    unix_deadlines = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("maximum") == bodies.MAX_DEADLINE:
                unix_deadlines.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(doc["components"]["schemas"]["JobCreate"])
    assert unix_deadlines and all(d["minimum"] == bodies.MIN_DEADLINE for d in unix_deadlines)


def test_the_metrics_page_names_every_registered_series(pages, gen):
    from prometheus_client import CollectorRegistry

    from tidepool.service.ledger.counters import REGISTRY
    from tidepool.workers.metrics import EngineMetrics
    page = pages[gen.REFERENCE / "metrics.md"]
    names = [c._name for c in REGISTRY._collector_to_names]
    names += [c._name for c in EngineMetrics(registry=CollectorRegistry()).registry._collector_to_names]
    names += ["tidepool:jobs", "tidepool:queue_depth", "tidepool:fair_service_gap", "tidepool:model_loaded"]
    for name in names:
        assert f"`{name}" in page, name
