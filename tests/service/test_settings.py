"""One settings object (service/ledger/settings.py's Config): every setting has a variable, a meaning and a default to
show (the docs' configuration page is generated from them: tests/docs/test_reference.py), and one spelling (its
variable and flag say its field's name); a bad value stops a process at start-up with a message naming the variable."""
import argparse
import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tidepool.service import create_app
from tidepool.service.ledger.settings import RENAMED, Config, SettingsError, variables
from tidepool.workers.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_has_a_variable_a_meaning_and_a_default_shown():
    names = [env for env, _, _ in variables()]
    assert len(names) == len(set(names)) and all(n.startswith("TIDEPOOL_") for n in names)
    assert all(shown and meaning for _, shown, meaning in variables())
    assert {"TIDEPOOL_VISIBILITY_TIMEOUT", "TIDEPOOL_LOG_LEVEL", "TIDEPOOL_SLA_REALTIME_ITL_MS",
            "TIDEPOOL_CAPACITY_POLICY", "TIDEPOOL_METRICS_PORT"} <= set(names)


@pytest.mark.parametrize("var,value,says", [
    ("TIDEPOOL_VISIBILITY_TIMEOUT", "abc", "expected a number"),
    ("TIDEPOOL_VISIBILITY_TIMEOUT", "-5", "must be > 0"),
    ("TIDEPOOL_LOW_WATER", "1.5", "expected an integer"),
    ("TIDEPOOL_LOG_LEVEL", "LOUD", "expected one of"),
    ("TIDEPOOL_CAPACITY_POLICY", "greedy", "expected one of"),
    ("TIDEPOOL_INSECURE_COOKIES", "maybe", "expected 1/true"),
    ("TIDEPOOL_ONLINE_RESERVE", "1.5", "must be in [0, 1)"),
    ("TIDEPOOL_REDIS_URL", "http://127.0.0.1:6379", "must be a redis:// URL"),
])
def test_a_bad_value_names_its_variable(var, value, says):
    with pytest.raises(SettingsError, match=var) as raised:
        Config.from_env(environ={var: value})
    assert says in str(raised.value)


def test_values_are_typed_and_empty_means_unset(tmp_path):
    cfg = Config.from_env({"storage_dir": str(tmp_path)}, environ={
        "TIDEPOOL_VISIBILITY_TIMEOUT": "120", "TIDEPOOL_LOW_WATER": "2", "TIDEPOOL_INSECURE_COOKIES": "1",
        "TIDEPOOL_LOG_LEVEL": "debug", "TIDEPOOL_SLA_REALTIME_ITL_MS": "80", "TIDEPOOL_METRICS_PORT": "0",
        "TIDEPOOL_NUM_KV_BLOCKS": "", "TIDEPOOL_ONLINE_RESERVE": "0.25",
        "TIDEPOOL_DATABASE_URL": f"sqlite:///{tmp_path}/t.db"})
    assert (cfg.visibility_timeout, cfg.low_water, cfg.insecure_cookies, cfg.log_level) == (120.0, 2, True, "DEBUG")
    assert cfg.metrics_port == 0 and cfg.num_kv_blocks is None and cfg.sla_overrides() == {"realtime": {"itl_ms": 80.0}}
    assert cfg.engine_fields() == {"online_reserve": 0.25}     # unset ones are left to the engine


# ---- one spelling per setting: field x_y, variable TIDEPOOL_X_Y, flag --x-y ------------------------------------------

def _options(parser, words=("tidepool",)):
    """(command words, action) for every argument of every subcommand of `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*words, name))
        elif not isinstance(action, argparse._HelpAction):
            yield " ".join(words), action


def test_a_setting_has_one_spelling():
    settings = {f.name: f.metadata for f in dataclasses.fields(Config) if "env" in f.metadata}
    wrong = [f"{name}: {m['env']}" for name, m in settings.items() if m["env"] != f"TIDEPOOL_{name.upper()}"]
    wrong += [f"{name}: {m['flag']}" for name, m in settings.items()
              if m["flag"] not in (None, "--" + name.replace("_", "-"))]
    # a command-line option sets a setting when its value lands in the field's name or it falls back to a variable
    setting_options = set()
    for command, action in _options(build_parser()):
        falls_back = re.findall(r"\$(TIDEPOOL_\w+)", action.help or "")
        if action.dest not in settings and not falls_back:
            continue
        setting_options.add(action.dest)
        spelled = "--" + action.dest.replace("_", "-")
        if action.option_strings != [spelled] or falls_back != [f"TIDEPOOL_{action.dest.upper()}"]:
            wrong.append(f"{command} {'/'.join(action.option_strings) or action.dest}: {falls_back}")
    assert not wrong, wrong
    assert {"model", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"} <= setting_options


def test_a_renamed_variable_stops_the_process_naming_the_new_one(tmp_path):
    names = {env for env, _, _ in variables()}
    assert set(RENAMED.values()) <= names and not set(RENAMED) & names
    for old, new in RENAMED.items():
        with pytest.raises(SettingsError, match=f"^{old} is now called {new}"):
            Config.from_env({"storage_dir": str(tmp_path)}, environ={old: "64", new: "64"})
    blank = Config.from_env({"storage_dir": str(tmp_path), "database_url": f"sqlite:///{tmp_path}/t.db"},
                            environ={old: " " for old in RENAMED})     # empty counts as unset, as everywhere
    assert blank.num_kv_blocks is None


def test_overrides_in_code_are_checked_too(tmp_path):
    with pytest.raises(SettingsError, match="TIDEPOOL_LEASE_SECONDS"):
        Config.from_env({"lease_seconds": 0, "storage_dir": str(tmp_path)}, environ={})


def test_an_unknown_override_is_an_error_naming_it(tmp_path):
    with pytest.raises(SettingsError, match="unknown setting lease_secs"):
        Config.from_env({"lease_secs": 5, "storage_dir": str(tmp_path)}, environ={})


def test_secrets_stay_out_of_the_repr(tmp_path):
    cfg = Config.from_env({"storage_dir": str(tmp_path), "database_url": f"sqlite:///{tmp_path}/t.db"},
                          environ={"TIDEPOOL_ADMIN_TOKEN": "adm-secret-1", "TIDEPOOL_METRICS_TOKEN": "m-secret-2"})
    assert cfg.admin_token == "adm-secret-1" and "adm-secret-1" not in repr(cfg) and "m-secret-2" not in repr(cfg)


def test_the_app_factory_refuses_a_bad_value(monkeypatch, tmp_path):
    monkeypatch.setenv("TIDEPOOL_AUTH_CACHE_TTL", "soon")
    with pytest.raises(SettingsError, match="TIDEPOOL_AUTH_CACHE_TTL"):
        create_app({"database_url": f"sqlite:///{tmp_path}/t.db", "storage_dir": str(tmp_path)})


def test_the_cli_stops_at_start_up_naming_the_variable(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(TIDEPOOL_VISIBILITY_TIMEOUT="abc", TIDEPOOL_DATABASE_URL=f"sqlite:///{tmp_path}/t.db")
    out = subprocess.run([sys.executable, "-m", "tidepool.workers.cli", "db", "upgrade"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert out.stderr.strip() == "tidepool: TIDEPOOL_VISIBILITY_TIMEOUT: expected a number, got 'abc'"
    assert not (tmp_path / "t.db").exists()      # nothing ran


# ---- nothing but service/ledger/settings.py reads TIDEPOOL_* from the environment ------------------------------------

def _is_tidepool_name(node) -> bool:
    """A product variable's name; TIDEPOOL_TEST_* and TIDEPOOL_BENCH_* belong to the test and benchmark harness."""
    if isinstance(node, ast.Constant):
        return (isinstance(node.value, str) and node.value.startswith("TIDEPOOL_")
                and not node.value.startswith(("TIDEPOOL_TEST_", "TIDEPOOL_BENCH_")))
    if isinstance(node, ast.JoinedStr) and node.values:
        return _is_tidepool_name(node.values[0])
    return False


def environment_reads(source: str) -> list[int]:
    """Lines where `source` reads (or writes) a TIDEPOOL_* variable of the environment: os.environ.get/[]/pop/
    setdefault, `in os.environ`, os.getenv, or any of them through a local alias (env = os.environ.get)."""
    tree = ast.parse(source)
    aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and re.fullmatch(r"(os\.)?(environ(\.get)?|getenv)", ast.unparse(node.value)) for t in node.targets
               if isinstance(t, ast.Name)}

    def is_env(expr) -> bool:
        return bool(re.search(r"environ|getenv", ast.unparse(expr))) or (isinstance(expr, ast.Name)
                                                                            and expr.id in aliases)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _is_tidepool_name(node.args[0]) and is_env(node.func):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _is_tidepool_name(node.slice) and is_env(node.value):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Compare) and _is_tidepool_name(node.left)
              and any(is_env(c) for c in node.comparators)):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_detector_sees_every_way_of_reading():
    source = ('import os\nfrom os import environ, getenv\nenv = os.environ.get\na = os.environ.get("TIDEPOOL_A")\n'
              'b = os.environ["TIDEPOOL_B"]\nc = env("TIDEPOOL_C", "1")\nd = getenv(f"TIDEPOOL_SLA_{x}")\n'
              'e = "TIDEPOOL_E" in environ\nos.environ.setdefault("TIDEPOOL_F", "1")\n'
              'sub = {**os.environ, "TIDEPOOL_G": "1"}\nok = environ.get("HOME")\ng = sub["TIDEPOOL_G"]\n'
              'pg = os.environ.get("TIDEPOOL_BENCH_PG")\n')
    assert environment_reads(source) == [4, 5, 6, 7, 8, 9]


def test_only_the_settings_module_reads_tidepool_variables():
    offenders = []
    for top in ("service", "workers", "kernels", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "service" / "config.py":
                continue
            offenders += [f"{path.relative_to(ROOT)}:{n}" for n in environment_reads(path.read_text())]
    assert offenders == [], f"read TIDEPOOL_* through service.ledger.settings.Config instead: {offenders}"
