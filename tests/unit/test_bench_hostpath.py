"""The host-path benchmarks must keep running as the code they drive changes (bench_hostpath hung once when ended walks
began to travel inside ``Emits``), and what they report must hold."""

from scripts.bench_hostpath import run


def test_every_decode_step_of_many_requests_sends_the_conductor_one_message():
    out = run(rows=4, steps=5)
    assert out["messages_per_step"] == 1.0  # one Emits with the step's tokens of all four requests
    assert out["bytes_per_step"] > 0 and out["step_us_median"] > 0


def test_the_http_path_benchmark_serves_through_either_parser_over_a_socket():
    """``bench_http_path.py --socket`` compares uvicorn's parsers over a real socket: a child serving with h11
    (httptools blocked: the fallback where it is not installed) and one with httptools (the dependency) must both
    answer the streamed requests."""
    from scripts.bench_http_path import measure_socket

    for parser in ("h11", "httptools"):
        out = measure_socket(parser, requests=40, warm=10)
        assert out["parser"] == parser and out["wall_us_per_request"] > 0
