"""The host-path benchmark drives a real worker and KV engine: it must keep running as they change (it hung once
when ended walks began to travel inside ``Emits``), and what it reports must hold."""

from scripts.bench_hostpath import run


def test_every_decode_step_of_many_requests_sends_the_conductor_one_message():
    out = run(rows=4, steps=5)
    assert out["messages_per_step"] == 1.0  # one Emits with the step's tokens of all four requests
    assert out["bytes_per_step"] > 0 and out["step_us_median"] > 0
