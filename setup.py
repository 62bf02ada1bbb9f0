"""The wheel's layout; everything else about the project is in pyproject.toml.

The checkout keeps web/ (templates, static files, Grafana JSON) and migrations/ at its top level; a wheel installs
them inside the service package, as service/web and service/migrations, where service/ledger/resources.py finds them.
tests/service/test_packaging.py builds the wheel, installs it outside the checkout and renders the panel from it.
"""
from setuptools import find_namespace_packages, setup

MAPPED = {"service.web": "web", "service.migrations": "migrations"}     # package -> folder in the checkout

packages = find_namespace_packages(include=["service*", "workers*", "kernels*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_namespace_packages(folder)]

setup(packages=packages, package_dir=MAPPED,
      package_data={"workers.tools": ["data/*.txt"], "kernels": ["csrc/*.cpp", "csrc/*.h"],
                    "service.migrations": ["*.mako"],
                    "service.web": ["templates/*.html", "static/*", "grafana/*.json"]})
