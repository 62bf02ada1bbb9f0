"""The wheel carries what an installed service needs besides code: web/ (templates, static files, Grafana JSON),
the migrations and the native kernel source. Built from a copy of this tree, installed into a fresh venv, and run
from a folder outside the checkout: migrations to head on SQLite, then the panel's sign-in page and its stylesheet."""
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["tidepool", "service", "workers", "kernels", "web", "migrations", "pyproject.toml", "setup.py", "README.md"]

SNIPPET = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from tidepool import service
    from tidepool.service import create_app, migrate
    site = Path(sys.argv[1]).resolve()
    assert Path(service.__file__).resolve().is_relative_to(site / "tidepool"), service.__file__
    migrate.upgrade(os.environ["TIDEPOOL_DATABASE_URL"])
    app = create_app()
    client = app.test_client()
    page = client.get("/admin/login")
    assert page.status_code == 200, page.status_code
    html = page.get_data(as_text=True)
    assert '<form method="post" action="/admin/login">' in html and 'name="token"' in html, html
    css = client.get("/admin/static/panel.css")
    assert css.status_code == 200 and css.data == (site / "tidepool/service/web/static/panel.css").read_bytes()
    css.close()
    assert "torch" not in sys.modules and "tidepool.workers" not in sys.modules, "the service side pulled in torch or workers"
    print("sign-in page rendered from", service.__file__)
""")


def test_wheel_installs_outside_the_checkout_and_renders_the_sign_in_page(tmp_path):
    src = tmp_path / "src"
    for name in SOURCES:      # a copy: the build writes build/ and *.egg-info beside the sources
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDEPOOL_", "PYTHON", "PIP_"))}
    env["PIP_NO_INPUT"] = "1"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(tmp_path / "dist"), str(src)], check=True, env=env, timeout=120)
    wheel, = (tmp_path / "dist").glob("tidepool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"tidepool"}, f"the wheel installs more than one top-level package: {sorted(tops)}"
    for rel in ["service/web/templates/login.html", "service/web/static/panel.css", "service/web/static/panel.js",
                "service/web/grafana/tidepool-dashboard.json", "service/migrations/env.py",
                "service/migrations/script.py.mako", "kernels/csrc/paged_decode_cpu.cpp", "kernels/csrc/fused_cpu.cpp",
                "kernels/csrc/simd.h", "workers/tools/data/corpus.txt"]:
        assert f"tidepool/{rel}" in names, f"tidepool/{rel} missing from the wheel"
    sources = {f"tidepool/{p.relative_to(src)}" for top in ("service", "workers", "kernels")
               for p in (src / top).rglob("*.py")}
    sources |= {f"tidepool/service/{p.relative_to(src)}" for top in ("web", "migrations") for p in (src / top).rglob("*")
                if p.is_file()}
    sources.add("tidepool/__init__.py")
    assert not sources - names, f"in the checkout, not in the wheel: {sorted(sources - names)}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the dependencies come from this venv's site-packages (appended to sys.path, after the wheel's own files);
    # nothing is downloaded, and the editable install there is not active (its .pth is not processed)
    (site / "zz_tidepool_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    "--ignore-installed", str(wheel)], check=True, env=env, timeout=120)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env.update(TIDEPOOL_DATABASE_URL=f"sqlite:///{elsewhere / 'ledger.db'}", TIDEPOOL_ADMIN_TOKEN="wheel-admin-token",
               TIDEPOOL_STORAGE_DIR=str(elsewhere / "storage"), TIDEPOOL_INSECURE_COOKIES="1")
    done = subprocess.run([str(python), "-c", SNIPPET, str(site)], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sign-in page rendered from" in done.stdout
