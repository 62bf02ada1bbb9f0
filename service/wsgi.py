"""gunicorn entry point: `gunicorn 'service.wsgi:app'`."""
from service import create_app
from service.ledger.logging import configure

configure()
app = create_app()
