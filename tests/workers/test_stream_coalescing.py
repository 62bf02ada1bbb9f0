"""Streamed tokens share Redis messages: a worker publishes one message per web process after a step that gave an
attempt its first token or ended one, and otherwise at most every COALESCE_S (workers/streaming.py). Counted with
Redis's own command statistics over real streams (Flask's streaming responses, a worker driven step by step):
whatever the window, every stream carries every token in order, and a longer window sends fewer messages."""
import json
import threading

import pytest

from tidepool.workers import streaming

from .test_intake import _close, _run_engine, _worker

STREAMS, TOKENS = 4, 24


def publishes(st) -> int:
    return st.redis.info("commandstats").get("cmdstat_publish", {}).get("calls", 0)


def stream_texts(st, w, key: str) -> list[str]:
    """STREAMS streamed completions at once (greedy): the text each stream carried."""
    client, bodies = st.app.test_client(), [None] * STREAMS

    def request(i: int) -> None:
        r = client.post("/v1/completions", json={"prompt": f"coalesce {i}", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
                                                 "stream": True}, headers={"Authorization": f"Bearer {key}"})
        bodies[i] = r.get_data(as_text=True)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    st.wait(lambda: st.redis.llen("interactive") == STREAMS, 30, "the requests' messages")
    while w.pull():
        pass
    _run_engine(w)
    assert w.finish_done()
    for t in threads:
        t.join(30)
    streamed = []
    for body in bodies:
        assert body.rstrip().endswith("data: [DONE]"), body
        chunks = [json.loads(line[len("data: "):]) for line in body.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        streamed.append("".join(c["choices"][0]["text"] for c in chunks))
    return streamed


@pytest.mark.parametrize("window", [0.0, 3600.0])
def test_every_token_streams_in_order_and_a_longer_window_sends_fewer_messages(stack, monkeypatch, window):
    st = stack
    _, key = st.tenant()
    w = _worker(st, "w")
    try:
        monkeypatch.setattr(streaming, "COALESCE_S", 0.0)
        expected = stream_texts(st, w, key)  # a message per step (and warm: the inbox listener, the key's cache)
        assert all(expected)
        monkeypatch.setattr(streaming, "COALESCE_S", window)
        before = publishes(st)
        assert stream_texts(st, w, key) == expected     # the same prompts, greedy: the same tokens, all of them
        sent = publishes(st) - before
        if window == 0.0:    # a message after every step (at least one per token) and the ends
            assert sent >= TOKENS, sent
        else:   # the first tokens' step, the last step; per job its doorbell ring and its end event; a spare ring
            assert sent <= 2 + 2 * STREAMS + 2, sent
    finally:
        _close(w)
