"""No route leaks another tenant's object; OpenAPI covers every route; health; CLI; which way imports point."""
import ast
import io
import json
from pathlib import Path

from tidepool.service.openapi import ROUTES
from tidepool.workers import cli



def test_no_route_leaks_another_tenants_object(client, admin):
    _, mine = admin.tenant()
    _, theirs = admin.tenant()
    job = client.post("/v1/jobs", json={"prompt": "x"}, headers=theirs).get_json()["id"]
    line = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line), "in.jsonl")},
                    headers=theirs).get_json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}, headers=theirs).get_json()["id"]
    probes = [("get", "/v1/jobs/{}", job, "job_missing"), ("post", "/v1/jobs/{}/cancel", job, "job_missing"),
              ("get", "/v1/files/{}", f, "file-missing"), ("get", "/v1/files/{}/content", f, "file-missing"),
              ("delete", "/v1/files/{}", f, "file-missing"), ("get", "/v1/batches/{}", batch, "batch_missing"),
              ("post", "/v1/batches/{}/cancel", batch, "batch_missing")]
    for method, path, other_id, missing_id in probes:
        leaked = getattr(client, method)(path.format(other_id), headers=mine)
        missing = getattr(client, method)(path.format(missing_id), headers=mine)
        assert leaked.status_code == missing.status_code == 404, path
        assert leaked.get_json()["error"]["code"] == missing.get_json()["error"]["code"] == "not_found"
    r = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=mine)
    assert r.status_code == 404
    for path in ("/v1/jobs", "/v1/files", "/v1/batches"):
        assert client.get(path, headers=mine).get_json()["data"] == [], path
    # and the owner still sees everything untouched
    assert client.get(f"/v1/jobs/{job}", headers=theirs).get_json()["status"] == "queued"
    assert client.get(f"/v1/batches/{batch}", headers=theirs).get_json()["status"] == "in_progress"


def test_openapi_documents_exactly_the_url_map(embedded_app):
    spec = embedded_app.test_client().get("/openapi.json").get_json()
    assert spec["openapi"].startswith("3.")
    documented = {(m, p) for p, ops in spec["paths"].items() for m in ops}
    served = set()
    for rule in embedded_app.url_map.iter_rules():
        # The HTML admin panel (/admin, session cookie) and the Prometheus text endpoint are not part of
        # the JSON API this document describes.
        if rule.endpoint.startswith("panel.") or rule.rule == "/metrics":
            continue
        path = rule.rule.replace("<", "{").replace(">", "}")
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            served.add((method.lower(), path))
    assert served == documented
    assert len(ROUTES) == len(documented)


def test_health_and_readiness(client, tmp_path, pg_url, redis_url):
    from tidepool.service import create_app
    from tidepool.workers.metrics import EngineMetrics, SnapshotStore
    assert client.get("/healthz").get_json() == {"status": "ok"}
    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path),
                      "model": str(tmp_path / "models" / "m1")})
    store = SnapshotStore(app.services.redis)
    store.clear()
    r = app.test_client().get("/readyz")       # no worker has its engine up yet
    assert r.status_code == 503 and "engine no worker with its engine up yet for m1" in r.get_json()["error"]["message"]
    store.put(EngineMetrics(worker="w-ready", model="/elsewhere/other-model").snapshot({}))
    assert app.test_client().get("/readyz").status_code == 503     # a worker for another model does not count
    store.put(EngineMetrics(worker="w-ready", model="models/m1").snapshot({}))
    r = app.test_client().get("/readyz")
    assert r.status_code == 200 and r.get_json()["checks"] == {"database": "ok", "broker": "ok", "engine": "ok"}
    store.clear()
    app.services.database.dispose()
    from tidepool.service import create_app
    down = create_app({"database_url": pg_url, "redis_url": "redis://127.0.0.1:1/0", "storage_dir": str(tmp_path)})
    r = down.test_client().get("/readyz")
    assert r.status_code == 503 and "broker" in r.get_json()["error"]["message"]
    down.services.database.dispose()


def test_unknown_route_and_method_are_openai_shaped(client):
    assert client.get("/v1/nope").get_json()["error"]["code"] == "not_found"
    r = client.put("/v1/jobs")
    assert r.status_code == 405 and r.get_json()["error"]["type"] == "invalid_request_error"


def test_cli_db_tenants_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    assert cli.main(["db", "upgrade"]) == 0
    capsys.readouterr()
    assert cli.main(["tenants", "create", "acme", "--weight", "2"]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["id"].startswith("ten_") and created["api_key"].startswith("tp_") and created["weight"] == 2.0
    assert cli.main(["tenants", "create", "acme"]) == 1
    capsys.readouterr()
    assert cli.main(["keys", "create", created["id"]]) == 0
    key = json.loads(capsys.readouterr().out)
    assert key["api_key"].startswith(key["prefix"] + "_")
    assert cli.main(["keys", "revoke", key["prefix"]]) == 0
    assert cli.main(["keys", "revoke", key["prefix"]]) == 1
    assert cli.main(["keys", "create", "ten_missing"]) == 1

    from tidepool.service import create_app
    app = create_app({"storage_dir": str(tmp_path / "s")})
    c = app.test_client()
    assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {created['api_key']}"}).status_code == 200
    assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {key['api_key']}"}).status_code == 401
    app.services.database.dispose()


def test_service_never_imports_torch(tmp_path):
    import subprocess
    import sys
    code = ("import sys; from tidepool.service import create_app, commands, migrate; "
            "from tidepool.service.ledger import batches, jobs, dispatch; "
            f"create_app({{'database_url': 'sqlite:///{tmp_path}/t.db', 'storage_dir': '{tmp_path}'}}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- import direction ---------------------------------------------------------------------------------------------
# By folder: service/protocol/ is the wire (the JSON the API takes and gives, as plain Python: no web framework,
# database, queue or torch, and nothing else of the project); service/ledger/ is the Flask-free core (models,
# transitions, admission and quotas, batches, files, the model registry, snapshots, the Celery wire format, token
# stream, settings), which may use the protocol; the rest of service/ is the Flask shell over both. Workers import
# service.ledger and service.protocol and nothing else of service; service never imports workers; the engine
# (workers/engine) and the kernels import neither; no module takes part in an import circle. Every `import`
# statement of every module counts, the ones inside functions too.
SERVICE, WORKERS, KERNELS = "tidepool.service", "tidepool.workers", "tidepool.kernels"
ENGINE = "tidepool.workers.engine"
LEDGER = "tidepool.service.ledger"
PROTOCOL = "tidepool.service.protocol"

# workers modules that put the web side together with the workers, and so may import any of service; a gpu/cpu
# worker process imports none of them but the CLI (test_gpu_worker_imports_without_flask)
COMPOSERS = {
    "tidepool.workers.cli": "the `tidepool` command registers service's subcommands (db, tenants, keys, web)",
    "tidepool.workers.engine_commands": "the CLI's engine-side subcommands; `tidepool models` holds service's registry "
                                        "commands too",
    "tidepool.workers.embedded": "`tidepool serve`: the API and a worker in one process",
}
WEB = ("flask", "werkzeug")
LEDGER_AND_QUEUES = ("sqlalchemy", "alembic", "psycopg", "celery", "kombu", "redis")
ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path) -> str:
    """The import name of a file of the checkout: service/ledger/jobs.py is tidepool.service.ledger.jobs."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == "tidepool" else ["tidepool", *parts])


def _project_modules() -> dict[str, Path]:
    return {_module_name(p): p for top in ("tidepool", "service", "workers", "kernels")
            for p in (ROOT / top).rglob("*.py")
            if "__pycache__" not in p.parts}


def _imports(name: str, path: Path, modules, top_level_only: bool = False) -> set[str]:
    """What `path` imports: `import a.b` gives a.b, `from a.b import c` gives a.b and a.b.c (a module or a name
    defined in a.b); relative imports resolved. top_level_only: the statements run at import time (not in a def)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = []
    if top_level_only:
        stack = list(tree.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                stack.extend(node.orelse)
                continue
            nodes.append(node)
            stack.extend(ast.iter_child_nodes(node))
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:    # a module, or a name defined in `module`
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
    return found


def _with_parents(names) -> set[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first."""
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, len(n.split(".")) + 1)}


def _import_time_closure(start: str, modules) -> set[str]:
    """Every module importing `start` loads (project modules followed through their top-level imports)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        for dep in _with_parents(_imports(name, modules[name], modules, top_level_only=True)):
            if dep not in seen:
                seen.add(dep)
                if dep in modules:
                    todo.append(dep)
    return seen


def _roots(names) -> set[str]:
    return {n.split(".")[0] for n in names}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_point_one_way():
    modules = _project_modules()
    assert COMPOSERS.keys() <= modules.keys(), f"listed but missing: {sorted(COMPOSERS.keys() - modules.keys())}"
    assert LEDGER in modules and PROTOCOL in modules
    wrong = []
    for name, path in sorted(modules.items()):
        deps = _imports(name, path, modules)
        if _within(name, PROTOCOL):
            wrong += [f"{name} imports {d} (the protocol imports no web framework, database, queue, torch, workers, "
                      "ledger or shell)" for d in deps if _roots([d]) & {*WEB, *LEDGER_AND_QUEUES, "torch"}
                      or _within(d, WORKERS) or (_within(d, SERVICE) and not _within(d, PROTOCOL))]
        elif _within(name, LEDGER):
            wrong += [f"{name} imports {d} (the ledger core imports no web framework, torch, workers or the shell)"
                      for d in deps if _roots([d]) & {*WEB, "torch"} or _within(d, WORKERS)
                      or (_within(d, SERVICE) and not _within(d, LEDGER) and not _within(d, PROTOCOL)
                          and d != SERVICE)]
        elif _within(name, SERVICE):
            wrong += [f"{name} imports {d} (service never imports workers)" for d in deps if _within(d, WORKERS)]
        elif _within(name, KERNELS):
            wrong += [f"{name} imports {d} (kernels import only kernels)" for d in deps
                      if _within(d, SERVICE) or _within(d, WORKERS) or _roots([d]) & {*WEB, *LEDGER_AND_QUEUES}]
        elif _within(name, ENGINE):
            wrong += [f"{name} imports {d} (the engine imports neither service nor the workers)" for d in deps
                      if _within(d, SERVICE) or _roots([d]) & {*WEB, *LEDGER_AND_QUEUES}
                      or (_within(d, WORKERS) and not _within(d, ENGINE) and d != WORKERS)]
        elif _within(name, WORKERS) and name not in COMPOSERS:
            wrong += [f"{name} imports {d} (workers import only {LEDGER} and {PROTOCOL} of service)"
                      for d in deps if _within(d, SERVICE) and not _within(d, LEDGER) and not _within(d, PROTOCOL)]
        elif name == "tidepool":
            wrong += [f"tidepool imports {d} at import time (the package root stays free of every part)"
                      for d in _imports(name, path, modules, top_level_only=True) if _within(d, "tidepool")]
    reference = f"{KERNELS}.paged_attention"     # the pure-torch definition every attention fast path is tested against
    wrong += [f"{reference} imports {d} (the reference is pure torch; kernels/attention.py picks the fast paths)"
              for d in _imports(reference, modules[reference], modules) if _within(d, KERNELS) or "triton" in _roots([d])]
    # importing the ledger runs service/__init__ first: that must stay as light as the ledger
    wrong += [f"importing service loads {d}" for d in sorted(_import_time_closure(SERVICE, modules))
              if _roots([d]) & {*WEB, "torch"} or _within(d, WORKERS)
              or (d in modules and _within(d, SERVICE) and not _within(d, LEDGER) and not _within(d, PROTOCOL)
                  and d not in (SERVICE, "tidepool"))]
    assert not wrong, "\n".join(wrong)


def test_one_top_level_import_package():
    """Every module of the checkout (the package, tests, benchmarks, docs, migrations, examples) imports the project
    as tidepool.*: a bare `service`, `workers` or `kernels` would load a second copy of a module (or Hugging Face's
    `kernels` package) beside the installed one."""
    bare = {"service", "workers", "kernels"}
    wrong = []
    for path in sorted(p for top in ("tidepool", "service", "workers", "kernels", "tests", "benchmarks", "docs",
                                      "migrations", "examples") for p in (ROOT / top).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if _roots([n]) & bare]
    assert not wrong, "\n".join(wrong)


# ---- queries live in the ledger ------------------------------------------------------------------------------------
# Every statement is built and run in service/ledger/, and every session, connection and transaction mode is set up
# there (ledger/database.py): the Flask shell and the workers call ledger functions with a session the ledger opened (and
# commit it), so a reader finds every query of a table in the ledger module that owns it. Outside the ledger (the
# rest of service/, workers/, kernels/) a module may import sqlalchemy's exceptions (to catch them), the
# Session/Engine/Connection types (to annotate) and `event` (to listen), and nothing else of it. migrations/
# (Alembic) is not a project package and is not looked at.
SQL_NAMES_ALLOWED = {"exc", "Session", "Engine", "Connection", "event"}
OPENS_ITS_OWN = {"Session", "sessionmaker", "scoped_session", "create_engine"}
RUNS_OR_SCOPES = {"execute", "scalars", "scalar", "query", "begin", "begin_nested", "execution_options"}


def _builds_queries(path: Path) -> list[str]:
    """Where `path` builds or runs a statement, or opens a session, connection or transaction of its own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _roots([a.name]) == {"sqlalchemy"}]
        elif isinstance(node, ast.ImportFrom) and not node.level and _roots([node.module or ""]) == {"sqlalchemy"}:
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if node.module != "sqlalchemy.exc" and a.name not in SQL_NAMES_ALLOWED]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in OPENS_ITS_OWN or (isinstance(f, ast.Attribute) and name in RUNS_OR_SCOPES
                                         and (node.args or name != "execute")):   # a Redis pipeline's execute()
                found.append(f"{node.lineno}: {ast.unparse(f)}(...)")
    return found


def test_queries_live_in_the_ledger():
    modules = _project_modules()
    wrong = [f"{path.relative_to(ROOT)}:{where}" for name, path in sorted(modules.items())
             if not _within(name, LEDGER) for where in _builds_queries(path)]
    assert not wrong, "built or run outside service/ledger/:\n" + "\n".join(wrong)
    # the rule sees what it is for: the ledger's own modules build queries and open sessions
    assert _builds_queries(modules[f"{LEDGER}.jobs"]) and _builds_queries(modules[f"{LEDGER}.database"])


# Two modules share a file name only where their folders say which is which: service/api/<resource>.py holds the HTTP
# routes of a resource, service/ledger/<resource>.py the ledger's operations on it. Every other name is unique across
# service/, workers/ and kernels/ (packages aside: each has its __init__.py), so a file name finds one module.
ROUTES_AND_LEDGER = {
    "batches.py": "/v1/batches routes; validating an input file into jobs, cancelling, finalising",
    "files.py": "/v1/files routes; the files quota counted with a file's row, expiry",
    "jobs.py": "/v1/jobs routes; the guarded job state transitions",
}


def test_module_file_names_are_unique():
    folders: dict[str, list[str]] = {}
    for top in ("tidepool", "service", "workers", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in path.parts and path.name != "__init__.py":
                folders.setdefault(path.name, []).append(path.parent.relative_to(ROOT).as_posix())
    pair = ["service/api", "service/ledger"]
    wrong = [f"{name} in {sorted(where)}" for name, where in sorted(folders.items())
             if len(where) > 1 and not (name in ROUTES_AND_LEDGER and sorted(where) == pair)]
    wrong += [f"{name} is listed as a routes/ledger pair but is in {sorted(folders.get(name, []))}"
              for name in ROUTES_AND_LEDGER if sorted(folders.get(name, [])) != pair]
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    modules = _project_modules()
    graph = {name: {d for d in _imports(name, path, modules) if d in modules and d != name}
             for name, path in modules.items()}
    circles = _circles(graph)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_gpu_worker_imports_without_flask():
    """A gpu worker process (`tidepool worker --kind gpu`) imports the CLI, then workers.worker and everything that
    can import (inside the workers' and kernels' functions too: the engine, torch), and never Flask."""
    import subprocess
    import sys
    modules = _project_modules()
    needed, todo = set(), ["tidepool.workers.worker"]
    while todo:
        name = todo.pop()
        lazy_too = not _within(name, SERVICE)   # service's lazy imports serve the API's callers
        for dep in _with_parents(_imports(name, modules[name], modules, top_level_only=not lazy_too)):
            if dep in modules and dep not in needed:
                needed.add(dep)
                todo.append(dep)
    assert {"tidepool.workers.engine", "tidepool.service.ledger.jobs", "tidepool.service.ledger.models"} <= needed
    code = ("import importlib, sys\n"
            "from tidepool.workers import cli\n"
            "args = cli.build_parser().parse_args(['worker', '--kind', 'gpu'])\n"
            f"for name in {sorted(needed)!r}:\n"
            "    importlib.import_module(name)\n"
            "web = sorted(m for m in sys.modules if m.split('.')[0] in ('flask', 'werkzeug'))\n"
            "assert not web, web\n"
            "assert 'torch' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_beat_runs_without_flask(tmp_path):
    """`tidepool beat` imports its Celery app, and its tasks sweep and finalise over services built from the settings
    (service/ledger/services.py), without ever importing Flask."""
    import subprocess
    import sys
    code = ("import sys\n"
            "from tidepool.service import migrate\n"
            "from tidepool.service.ledger.settings import Config\n"
            "from tidepool.workers import beat, celery_app\n"
            f"cfg = Config.from_env({{'storage_dir': {str(tmp_path)!r}, "
            f"'database_url': 'sqlite:///{tmp_path}/beat.db'}}, environ={{}})\n"
            "migrate.upgrade(cfg.database_url)\n"
            "app = celery_app.make_celery(cfg)\n"
            "assert {'tidepool.sweep', 'tidepool.finalize_batches'} <= set(app.tasks)\n"
            "assert set(app.tasks['tidepool.sweep']()) >= {'reclaimed', 'republished', 'files_expired'}\n"
            "assert app.tasks['tidepool.finalize_batches']() == 0\n"
            "web = sorted(m for m in sys.modules if m.split('.')[0] in ('flask', 'werkzeug'))\n"
            "assert not web, web\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_checkout_hides_no_distribution_of_the_same_name(tmp_path):
    """From the checkout's root (the tests, `python -m`, the benchmarks all put it on the path) `import kernels` finds
    Hugging Face's package where it is installed (transformers imports it to load any model), never the checkout's
    kernels/ folder, and the project's own modules are still found as tidepool.*."""
    import subprocess
    import sys
    code = ("import sys, importlib.util\n"
            "from pathlib import Path\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "assert spec is None or spec.origin is None or Path(spec.origin).parent != Path(sys.argv[1], 'kernels'), "
            "spec.origin\n"
            "assert importlib.util.find_spec('tidepool.kernels.paged_attention').origin.startswith(sys.argv[1])\n")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
