#!/usr/bin/env bash
# Wheels of the service's packages that the GPU machine's image lacks (it has torch, triton, transformers, pytest,
# click, jinja2, werkzeug...; no Flask, SQLAlchemy, Alembic, Celery, Kombu or redis-py), at the versions of this
# checkout's .venv, for the image's Python (3.12), into .whl/ (git-ignored through .git/info/exclude). Run here,
# where PyPI is reachable; gpu_check.sh installs them there (the device call carries .whl).
#
#     bash benchmarks/gpu_wheels.sh && grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON_VERSION:-3.12}"
pkgs=(flask werkzeug itsdangerous blinker click sqlalchemy alembic mako celery kombu billiard vine amqp redis tzlocal waitress)
pins=()
for p in "${pkgs[@]}"; do
    pins+=("$p==$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
ls .whl
