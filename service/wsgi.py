"""gunicorn entry point: `gunicorn 'tidepool.service.wsgi:app'`."""
from tidepool.service import create_app
from tidepool.service.ledger.logging import configure

configure()
app = create_app()
