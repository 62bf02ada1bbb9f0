"""deploy/Containerfile, checked where no container engine runs: read as instructions, it builds the wheel in a
builder stage from the folders the wheel is made of and installs it, runs as an unprivileged user, has `tidepool`
as its entrypoint, never copies a model, and prebuilds the native CPU kernels into the folder the workers look in;
that prebuild step runs here too, and a worker's start-up finds what it left."""
import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"


def instructions(path: Path = CONTAINERFILE) -> list[list[tuple[str, str]]]:
    """The stages, each a list of (INSTRUCTION, arguments), continuation lines joined and comments dropped."""
    stages: list[list[tuple[str, str]]] = [[]]
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        pending = ""
        if word.upper() == "FROM":
            stages.append([])
        stages[-1].append((word.upper(), " ".join(rest.split())))
    return stages


def stage_env(stage) -> dict:
    env = {}
    for word, rest in stage:
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def test_a_builder_stage_builds_the_wheel_and_the_image_installs_it():
    preamble, *stages = instructions()
    assert len(stages) >= 2 and all(word == "ARG" for word, _ in preamble)
    builder, final = stages[0], stages[-1]
    assert builder[0][1].endswith(" AS builder")
    runs = " ".join(rest for word, rest in builder if word == "RUN")
    assert "pip wheel" in runs and "--wheel-dir /wheels ." in runs
    assert re.search(r"pip install [^&]*/wheels/tidepool-\*\.whl", runs), "the image installs something else"
    copies = [rest for word, rest in final if word == "COPY"]
    assert copies == ["--from=builder /opt/tidepool /opt/tidepool"], copies
    assert stage_env(final)["PATH"].startswith("/opt/tidepool/bin:")


def test_the_builder_copies_what_the_wheel_is_made_of():
    tree = ast.parse((ROOT / "setup.py").read_text())
    mapped, = [ast.literal_eval(node.value) for node in tree.body
               if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MAPPED"]
    needed = {"pyproject.toml", "setup.py", "README.md", "tidepool", *mapped.values()}
    copied = set()
    for word, rest in instructions()[1]:
        if word == "COPY":
            *sources, _ = rest.split()
            copied |= set(sources)
    assert needed <= copied, sorted(needed - copied)
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not copied & ignored and {"models", ".venv"} <= ignored


def test_the_torch_wheel_is_the_one_the_project_pins():
    pins = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
            if d.startswith("torch")]
    builder = instructions()[1]
    args = dict(rest.split("=", 1) for word, rest in builder if word == "ARG" and "=" in rest)
    assert pins == [f"torch=={args['TORCH_VERSION']}"]
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu"), "the default build is the CPU variant"
    runs = " ".join(rest for word, rest in builder if word == "RUN")
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in runs


def test_no_model_goes_into_the_image():
    for stage in instructions():
        for word, rest in stage:
            assert word != "ADD", "ADD can fetch URLs and unpack archives; the recipe copies with COPY"
            if word == "COPY":
                assert "models" not in rest.split()[0:-1], rest
    from tidepool.service.ledger.settings import Config
    env = stage_env(instructions()[-1])
    assert "TIDEPOOL_MODEL" not in env, "the model folder is the deployment's: a mount, named at run time"
    assert env["TIDEPOOL_MODELS_DIR"] == "/models"
    Config.env_values(env)


def test_it_runs_as_an_unprivileged_user_with_tidepool_as_entrypoint():
    final = instructions()[-1]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    entrypoint, = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["tidepool"]
    uid = users[-1].split(":")[0]
    runs = " ".join(rest for word, rest in final if word == "RUN")
    assert f"--uid {uid}" in runs


def _prebuild(final) -> tuple[int, str]:
    """(position, Python source) of the RUN that builds the native kernels."""
    hits = [(i, rest) for i, (word, rest) in enumerate(final) if word == "RUN" and "cpu_ops.prepare()" in rest]
    assert len(hits) == 1, "one RUN prebuilds the native CPU kernels"
    i, rest = hits[0]
    words = shlex.split(rest)
    assert words[:2] == ["python", "-c"]
    return i, words[2]


def test_the_kernels_are_prebuilt_by_the_runtime_user_into_the_workers_cache_folder():
    final = instructions()[-1]
    i, source = _prebuild(final)
    before = final[:i]
    cache = stage_env(before)["TIDEPOOL_KERNEL_CACHE"]
    assert any(word == "USER" for word, _ in before), "built as root, the cache would not be the worker's to extend"
    runs = " ".join(rest for word, rest in before if word == "RUN")
    assert re.search(rf"install -d -o (\d+) -g \1 [^&]*{re.escape(cache)}", runs)
    assert "Config.setting('kernel_cache')" in source and "sys.exit(state != 'ready')" in source


def test_the_prebuild_step_leaves_what_a_worker_finds_at_start(tmp_path):
    """The image's prebuild, run here with the image's settings (its cache folder moved to this machine's default
    one, which the engine tests build into as well, so this costs a build only where none ran yet); then a worker's
    start-up, configured from the same settings as the engine is (workers/config_fields.py), finds the library
    without building: prepare(background=True) answers `building` where it would have to."""
    from tidepool.kernels import cpu_ops
    final = instructions()[-1]
    _, source = _prebuild(final)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update({k: v for k, v in stage_env(final).items() if k.startswith("TIDEPOOL_")})
    env["TIDEPOOL_KERNEL_CACHE"] = str(cpu_ops.cache_dir())
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", source], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "native CPU kernels: ready" in done.stdout
    start = ("from tidepool.kernels import cpu_ops\n"
             "from tidepool.service.ledger.settings import Config\n"
             "from tidepool.workers.config_fields import engine_fields\n"
             "engine = engine_fields(Config.from_env(), 'cpu')\n"
             "cpu_ops.configure(engine.get('cpu_kernels'), engine.get('kernel_cache'))\n"
             "print(cpu_ops.prepare(background=True))\n")
    found = subprocess.run([sys.executable, "-c", start], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.split()[-1] == "ready", found.stdout + found.stderr[-3000:]
