"""The host-path benchmarks must keep running as the code they drive changes (bench_hostpath hung once when ended walks
began to travel inside ``Emits``), and what they report must hold."""

import pytest

from scripts.bench_hostpath import run


def smollm2_weights() -> str:
    """The real SmolLM2 weights directory (prepared from the weights package), or skip the test where it is absent."""
    from models.llama.gguf_import import DEFAULT_SMOLLM2_DIR, default_smollm2_gguf, ensure_smollm2_weights

    try:
        default_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return str(ensure_smollm2_weights(DEFAULT_SMOLLM2_DIR, progress=lambda _: None))


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


def test_a_burst_of_prompts_beside_decoding_requests_reaches_its_emits():
    """``bench_hostpath.py --prefill``: a batch of new prompts beside requests that keep decoding must end its prefill
    walks (the benchmark raises otherwise) with the decode walks still running (asserted inside)."""
    from scripts.bench_hostpath import run_prefill

    out = run_prefill(rows=5, batches=2, decoding=3)
    assert out["rows"] == 5 and out["batch_us_median"] > 0


def test_the_intake_benchmark_drives_an_intakes_own_backend_with_its_tokenizer():
    """``bench_http_path.py --intake``: the app over ``IntakeBackend`` (chat template, tokenizer, ``Submit`` encoded)
    must answer every streamed /generate with a 200 and both deltas."""
    import asyncio

    from scripts.bench_http_path import measure_intake

    out = asyncio.run(measure_intake(smollm2_weights(), requests=20))  # raises on any answer but a 200
    assert out["requests"] == 20 and out["response_bytes"] > 100


def test_the_admission_benchmark_carries_every_burst_through_the_conductors_own_loop():
    """``bench_admission.py --wire``: the conductor's thread and loop over real control channels must take every
    ``Submit`` of each burst from the intake's channel and hand the rank a ``RunWalk`` for each (the child raises, and
    ``wire`` with it, when one is missing after 30 s)."""
    from scripts.bench_admission import wire

    out = wire(smollm2_weights(), burst=5, rounds=3)
    assert out["burst"] == 5 and out["rounds"] == 3
    assert out["burst_span_ms_median"] > 0 and out["conductor_process_cpu_us_per_request"] > 0
