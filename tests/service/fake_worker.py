"""A thread that plays the gpu worker for online requests in the API suites: it starts each queued job (of one
tenant, or every tenant), optionally streams a token, and completes it in the ledger, on either ledger."""
import threading
import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from tidepool.service.ledger import jobs, token_stream
from tidepool.service.ledger.models import Job, JobStatus


class FakeWorker:
    def __init__(self, app, tenant_id: str | None = None, output: str = "Hello"):
        self.engine = app.services.database
        self.hub = token_stream.for_redis(app.services.redis)
        self.tenant_id, self.output = tenant_id, output
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)

    def run(self):
        while not self.stop.is_set():
            with Session(self.engine) as s:
                stmt = select(Job.id).where(Job.status == JobStatus.queued)
                if self.tenant_id:
                    stmt = stmt.where(Job.tenant_id == self.tenant_id)
                job_id = s.scalar(stmt.order_by(Job.id))
            if job_id is None:
                time.sleep(0.02)
                continue
            with Session(self.engine) as s:
                started = jobs.start(s, job_id, "fake")
                s.commit()
            if started is None or started.lease_token is None:
                continue
            with Session(self.engine) as s:
                jobs.complete(s, job_id, started.lease_token, output=self.output, output_token_ids=[1],
                              prompt_tokens=1, completion_tokens=1, finish_reason="stop")
                s.commit()
            self.hub.publish(job_id, {"t": "end", "status": "completed"})
