"""The wheel's layout; everything else about the project is in pyproject.toml.

One import package, `tidepool`. The checkout keeps its parts in top-level folders, mapped into it here: service/,
workers/ and kernels/ become tidepool.service, tidepool.workers and tidepool.kernels; web/ (templates, static files,
Grafana JSON) and migrations/ go inside the service package, as tidepool/service/web and tidepool/service/migrations,
where service/resources.py finds them. tests/service/test_packaging.py builds the wheel, installs it outside
the checkout and renders the panel from it.
"""
from setuptools import find_namespace_packages, setup

MAPPED = {"tidepool.service": "service", "tidepool.workers": "workers", "tidepool.kernels": "kernels",
          "tidepool.service.web": "web", "tidepool.service.migrations": "migrations"}   # package -> checkout folder

packages = ["tidepool"]
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])
                          if f"{name}.{sub}" not in MAPPED]

setup(packages=packages, package_dir={"tidepool": "tidepool", **MAPPED},
      package_data={"tidepool.workers.tools": ["data/*.txt"], "tidepool.kernels": ["csrc/*.cpp", "csrc/*.h"],
                    "tidepool.service.migrations": ["*.mako"],
                    "tidepool.service.web": ["templates/*.html", "static/*", "grafana/*.json"]})
