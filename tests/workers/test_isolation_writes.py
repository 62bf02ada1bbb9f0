"""A finished result that cannot be written because the ledger is down (Postgres taken away behind a proxy)
is written again in place once it is back: the job completes exactly once, on its first attempt, without
waiting for its lease to lapse and running again."""
from tidepool.service.ledger.database import make_engine
from tidepool.service.ledger.models import JobStatus

from ..tcp_proxy import TcpProxy
from .test_intake import _close, _job, _run_engine, _worker


def test_a_result_refused_by_a_ledger_outage_is_written_when_it_returns(stack):
    st = stack
    _, key = st.tenant()
    ids = st.submit(key, 3, prompt="write me", max_tokens=3, ignore_eos=True)
    host, port = st.db_url.split("@", 1)[1].split("/", 1)[0].split(":")
    proxy = TcpProxy(host, int(port)).start()
    w = _worker(st, "w")
    w.db.dispose()
    w.db = make_engine(proxy.url_for(st.db_url))
    try:
        assert w.pull()
        _run_engine(w)
        proxy.stop()                           # the database restarts just as the results are ready
        assert w.finish_done()
        assert len(w.results.unwritten) == 3 and st.redis.hlen("unacked") == 3
        assert all(_job(st, i).status == JobStatus.running for i in ids)
        w.results.retry_at = 0
        w.finish_done()                       # still down: kept, and the pause grows
        assert len(w.results.unwritten) == 3 and w.results.retry_pause > 0.5
        proxy.start()
        w.results.retry_at = 0
        assert w.finish_done()
        assert not w.results.unwritten and not st.redis.hlen("unacked")      # written, then acked
        for i in ids:
            job = _job(st, i)
            assert (job.status, job.attempts, job.completion_tokens) == (JobStatus.completed, 1, 3)
        assert w.counters["completed"] == 3
    finally:
        proxy.stop()
        _close(w)
