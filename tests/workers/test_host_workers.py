"""Which workers one host runs: `tidepool worker --kind auto`, the Procfile's and the default,
runs one engine serving every class on a host without a GPU, and on a GPU host the gpu worker plus a cpu worker
(deferrable) beside it, as `tidepool serve` does; names say the device and the role."""
from pathlib import Path

from tidepool.workers.cli import build_parser
from tidepool.workers.worker import WorkerConfig, host_workers, role

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


def test_a_gpu_host_runs_both_workers_in_one_process(tmp_path, tiny_model, monkeypatch, capsys):
    """`--kind auto` on a GPU host (the pairs faked onto the CPU): both workers start, each with its /metrics and
    start-up line, TIDEPOOL_WORKER_NAME names the gpu one and `<name>-deferrable` the cpu one; when one of them
    ends the other is stopped and the process exits non-zero if one failed, so a supervisor restarts both."""
    import argparse
    import json
    import threading

    from tidepool.workers import worker as worker_module

    ran = []

    class FakeWorker:
        def __init__(self, cfg):
            self.cfg, self._stop = cfg, threading.Event()
            self.metrics = type("M", (), {"registry": None})()

        def run(self):
            ran.append(self.cfg.name)
            if self.cfg.kind == "cpu":
                raise RuntimeError("engine loop failed")
            assert self._stop.wait(30)

        def stop(self):
            self._stop.set()

    monkeypatch.setenv("TIDEPOOL_MODEL", tiny_model)      # its config.json is checked before the workers start
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", f"sqlite:///{tmp_path}/t.db")
    monkeypatch.setenv("TIDEPOOL_WORKER_NAME", "edge-1")
    monkeypatch.setattr(worker_module, "Worker", FakeWorker)
    monkeypatch.setattr(worker_module, "bind_metrics_server", lambda port, registry: port)
    monkeypatch.setattr(worker_module, "host_workers", lambda kind, device: [("gpu", "cpu"), ("cpu", "cpu")])
    monkeypatch.setattr(worker_module.signal, "signal", lambda *_: None)     # pytest keeps its own handlers
    args = argparse.Namespace(kind="auto", device="cpu", engine={})
    assert worker_module.main(args) == 1
    starts = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(s["worker"], s["kind"], s["metrics_port"]) for s in starts] == [("edge-1", "gpu", 9101),
                                                                          ("edge-1-deferrable", "cpu", 9102)]
    assert sorted(ran) == ["edge-1", "edge-1-deferrable"]
