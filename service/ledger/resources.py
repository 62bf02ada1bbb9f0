"""Where the service's non-Python files are. A wheel installs web/ and migrations/ inside the package (service/web,
service/migrations; see setup.py); in a checkout, editable install included, they sit at its top level."""
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]     # service/


def _folder(name: str) -> Path:
    installed = _PACKAGE / name
    return installed if installed.is_dir() else _PACKAGE.parent / name


WEB = _folder("web")                    # templates/, static/, grafana/
MIGRATIONS = _folder("migrations")      # alembic's script location
