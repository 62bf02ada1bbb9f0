"""The web app's class: a Flask app that holds the process's services (service/ledger/services.py), and
`services()`, the current app's."""
from typing import cast

from flask import Flask, current_app

from .ledger.services import Services


class App(Flask):
    services: Services

    def __init__(self, import_name: str, services: Services, **kwargs):
        super().__init__(import_name, **kwargs)
        self.services = services


def services() -> Services:
    """The services of the app handling the current request (or whose app context is pushed)."""
    return cast(App, current_app).services
