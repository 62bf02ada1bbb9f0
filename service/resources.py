"""Where the service's non-Python files are. A wheel installs web/ and migrations/ inside the package
(tidepool/service/web, tidepool/service/migrations; see setup.py); in a checkout, editable install included, they sit
at its top level. The admin panel (templates, static files) and the migrations read them from here."""
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent     # service/


def _folder(name: str) -> Path:
    installed = _PACKAGE / name
    return installed if installed.is_dir() else _PACKAGE.parent / name


WEB = _folder("web")                    # templates/, static/, grafana/
MIGRATIONS = _folder("migrations")      # alembic's script location
