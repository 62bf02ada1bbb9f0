"""Which workers one host runs (issue 32 point 1): `tidepool worker --kind auto`, the Procfile's and the default,
runs one engine serving every class on a host without a GPU, and on a GPU host the gpu worker plus a cpu worker
(deferrable) beside it, as `tidepool serve` does; names say the device and the role."""
from pathlib import Path

from workers.cli import build_parser
from workers.worker import WorkerConfig, host_workers, role

ROOT = Path(__file__).resolve().parents[2]


def test_auto_is_one_engine_on_a_host_without_a_gpu():
    assert host_workers("auto", "cpu") == [("gpu", "cpu")]
    assert host_workers("auto", "cuda") == [("gpu", "cuda"), ("cpu", "cpu")]
    assert host_workers("gpu", "cpu") == [("gpu", "cpu")] and host_workers("cpu", "cpu") == [("cpu", "cpu")]


def test_the_procfile_and_the_default_take_the_kind_from_the_host():
    assert build_parser().parse_args(["worker"]).kind == "auto"
    workers = [line for line in (ROOT / "Procfile").read_text().splitlines() if "tidepool worker" in line]
    assert workers == ["worker: tidepool worker --kind auto"]


def test_names_say_the_device_and_the_role(tmp_path):
    def name(kind, device):
        return WorkerConfig(model=str(tmp_path), database_url="sqlite://", kind=kind, device=device).name
    assert name("gpu", "cpu").startswith("cpu-") and name("gpu", "cuda").startswith("gpu-")
    assert name("cpu", "cpu").startswith("cpu-deferrable-")
    assert (role("gpu", "cpu"), role("gpu", "cuda:1"), role("cpu", "cpu")) == ("cpu", "gpu", "cpu-deferrable")
    cfg = WorkerConfig(model=str(tmp_path), database_url="sqlite://", kind="gpu", device="cpu")
    assert cfg.queues == ("realtime", "interactive", "batch", "deferrable")
