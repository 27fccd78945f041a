"""What structured output costs a decode step: the KV engine's step at a batch of ``--batch`` rows, every row under a
JSON-schema grammar against every row unconstrained, rounds alternated (medians reported).

    python scripts/bench_guided.py [--weights DIR] [--batch 8] [--steps 40] [--rounds 5] [--threads 2] [--out FILE]

Both modes draw (temperature 1, one seed a row) from the same prompts on the same engine (SmolLM2 by default, CPU);
the guided rows' grammar is a JSON object whose one string field is long enough that no row ends during a round, so
every step computes every row's mask (engine/grammar.py) and applies it on the device. Prints one JSON object:
per-step milliseconds of each mode (median over rounds of each round's median step) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.llama.chat import LlamaChat  # noqa: E402
from mstar_dist.config.engine import EngineConfig  # noqa: E402
from mstar_dist.engine.component import WalkContext  # noqa: E402
from mstar_dist.engine.sampling import SamplingParams  # noqa: E402
from mstar_dist.events import GuidedSpec  # noqa: E402
from mstar_dist.graph.walk import NodeCall  # noqa: E402

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 4000}},
          "required": ["story"], "additionalProperties": False}
"""A long string field: the rows stay inside the grammar's string state for the whole round."""


class _Run:
    """Stands in for a walk: what a call needs of it (``request_id``, ``ctx``)."""

    def __init__(self, request_id: str, ctx: WalkContext) -> None:
        self.request_id, self.ctx = request_id, ctx


def _call(rid: str, inputs: dict, params: SamplingParams, iteration: int, state: dict) -> NodeCall:
    ctx = WalkContext(request_id=rid, walk="decode", walk_index=1, seed=params.seed, sampling=params, state=state)
    return NodeCall(run=_Run(rid, ctx), node="LLM", inputs=inputs, iteration=iteration)


def round_ms(engine, tokenizer, batch: int, steps: int, guided: bool, tag: str) -> float:
    """One round: prefill ``batch`` prompts, then ``steps`` decode steps of all rows; the median step in ms."""
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA)) if guided else None
    params = [SamplingParams(temperature=1.0, seed=i, guided=spec) for i in range(batch)]
    ids = [f"{tag}{i}" for i in range(batch)]
    prompts = [torch.tensor(tokenizer.encode(f"Write story number {i} as JSON:")) for i in range(batch)]
    states = [{} for _ in range(batch)]
    results = engine.run_batch([_call(r, {"input_ids": p}, q, 0, s)
                                for r, p, q, s in zip(ids, prompts, params, states)])
    times = []
    for step in range(steps):
        calls = [_call(r, {"token": res.outputs["token"]}, q, step, s)
                 for r, res, q, s in zip(ids, results, params, states)]
        t0 = time.perf_counter()
        results = engine.run_batch(calls)
        times.append(time.perf_counter() - t0)
        assert all(hasattr(res, "outputs") for res in results), results
    for rid in ids:
        engine.release(rid)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="~/.cache/mstar_dist/smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    weights = str(Path(args.weights).expanduser())
    family = LlamaChat(weights)
    family.load_frontend()
    engine = family.build_component("LLM", device="cpu", walks={"prefill", "decode"},
                                    engine=EngineConfig(max_batch=args.batch, max_seq_len=512, cuda_graphs=False))
    engine.warmup()
    with torch.inference_mode():
        round_ms(engine, family.tokenizer, args.batch, 4, True, "warm")  # the grammar tokenizer is built here
        ms: dict[str, list[float]] = {"unconstrained": [], "guided": []}
        for r in range(args.rounds):
            for mode in ("unconstrained", "guided") if r % 2 == 0 else ("guided", "unconstrained"):
                ms[mode].append(round_ms(engine, family.tokenizer, args.batch, args.steps, mode == "guided",
                                         f"{mode}{r}-"))
    out = {"batch": args.batch, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
           **{f"{mode}_step_ms": statistics.median(v) for mode, v in ms.items()},
           "rounds_ms": ms}
    out["guided_over_unconstrained"] = out["guided_step_ms"] / out["unconstrained_step_ms"]
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
