"""The load clients people point at an OpenAI-compatible server, run against a deployment: guidellm (streaming chat
and completions at 1 and 8 concurrent requests) and aiperf (streaming chat and completions), synthetic prompts and a
fixed output length, each request checked: how many failed, and whether every answer has exactly the tokens asked
(both clients hold the length with vLLM's ``ignore_eos``; guidellm reads it from the running usage, aiperf from the
final usage with ``--use-server-token-count``).

    python scripts/bench_clients.py [--config launch/configs/smollm2_pd.yaml:2] [--aiperf PATH] [--clients LIST]
        [--out FILE]

aiperf pins its own transformers, so it lives in a venv of its own (``--aiperf``: its executable; "" skips it);
guidellm is the test extra's. Prints one JSON object: per run the command, requests served / failed / incomplete,
the output lengths seen, and the clients' own throughput and latency figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.server import WEIGHTS, Server  # noqa: E402

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def guidellm(base_url: str, route: str, streams: int, requests: int, prompt_tokens: int, output_tokens: int,
             work: Path) -> dict:
    """One guidellm run; its requests' outcome from its JSON report."""
    out = work / f"guidellm_{route}_{streams}.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={base_url},model=smollm2,request_format={ROUTES[route]}",
           "--profile", f"kind=concurrent,streams={streams}", "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={WEIGHTS}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=work, env={**os.environ, **OFFLINE})
    if run.returncode != 0:
        return {"command": " ".join(cmd), "returncode": run.returncode, "stderr": run.stderr[-2000:]}
    (bench,) = json.loads(out.read_text())["benchmarks"]
    done = bench["requests"]["successful"]
    return {
        "command": " ".join(cmd[1:]).replace(str(WEIGHTS), "SMOLLM2_DIR"),
        "served": len(done), "failed": len(bench["requests"]["errored"]),
        "incomplete": len(bench["requests"]["incomplete"]),
        "output_tokens": sorted({r["output_tokens"] for r in done}),
        "exact_lengths": all(r["output_tokens"] == output_tokens for r in done),
        "output_tok_s": round(sum(r["output_tokens"] for r in done) / bench["duration"], 2),
        "ttft_median_ms": round(statistics.median(r["time_to_first_token_ms"] for r in done), 1),
        "itl_median_ms": round(statistics.median(r["inter_token_latency_ms"] for r in done), 1),
    }


def aiperf(exe: str, base_url: str, route: str, concurrency: int, requests: int, prompt_tokens: int,
           output_tokens: int, work: Path) -> dict:
    """One aiperf run; its requests' outcome from its per-request export."""
    art = work / f"aiperf_{route}"
    cmd = [exe, "profile", "--model", "smollm2", "--url", base_url, "--endpoint-type", route, "--streaming",
           "--tokenizer", str(WEIGHTS), "--concurrency", str(concurrency), "--request-count", str(requests),
           "--synthetic-input-tokens-mean", str(prompt_tokens), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--ui-type", "none",
           "--output-artifact-dir", str(art)]
    # not OFFLINE: aiperf's offline mode looks a tokenizer up in the hub's cache only, never at a local path
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=work)
    records = [json.loads(line) for path in art.rglob("*.jsonl") if "export" in path.name
               for line in path.read_text().splitlines() if line.strip()]
    lengths, errors = [], 0
    for rec in records:
        if rec.get("error"):
            errors += 1
            continue
        metric = rec.get("metrics", {}).get("output_sequence_length")
        lengths.append(metric.get("value") if isinstance(metric, dict) else metric)
    summary = next(iter(sorted(art.rglob("profile_export_aiperf.json"))), None)
    figures = json.loads(summary.read_text()) if summary else {}
    tok_s = figures.get("output_token_throughput", {})
    return {
        "command": " ".join(["aiperf", *cmd[1:]]).replace(str(WEIGHTS), "SMOLLM2_DIR"),
        "returncode": run.returncode, "served": len(lengths), "failed": errors,
        "output_tokens": sorted({x for x in lengths if x is not None}),
        "exact_lengths": bool(lengths) and all(x == output_tokens for x in lengths),
        "output_tok_s": round(tok_s.get("avg", 0.0), 2) if isinstance(tok_s, dict) else tok_s,
        **({"output": (run.stdout + run.stderr)[-2000:]} if run.returncode != 0 else {}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "launch/configs/smollm2_pd.yaml") + ":2",
                   help="the deployment and its rank count")
    p.add_argument("--aiperf", default="/work/venvs/aiperf/bin/aiperf", help='aiperf\'s executable ("": skip it)')
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--clients", default="guidellm,aiperf", help="which clients to run (comma-separated)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    path, nproc = args.config.rsplit(":", 1)
    started = time.monotonic()
    server = Server(path, nproc=int(nproc))
    result: dict = {"config": Path(path).name, "ranks": int(nproc), "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens, "start_to_healthy_s": round(time.monotonic() - started, 1),
                    "guidellm": {}, "aiperf": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            clients = args.clients.split(",")
            for route in ROUTES:
                for streams, requests in ((1, 4), (8, 16)) if "guidellm" in clients else ():
                    result["guidellm"][f"{route}@{streams}"] = guidellm(
                        server.base_url, route, streams, requests, args.prompt_tokens, args.output_tokens, work)
                    print(route, streams, json.dumps(result["guidellm"][f"{route}@{streams}"]), flush=True)
                if args.aiperf and "aiperf" in clients:
                    result["aiperf"][f"{route}@4"] = aiperf(args.aiperf, server.base_url, route, 4, 16,
                                                            args.prompt_tokens, args.output_tokens, work)
                    print(route, "aiperf", json.dumps(result["aiperf"][f"{route}@4"]), flush=True)
    finally:
        result["server_exit_clean"] = server.stop_clean(int(nproc))
    runs = [*result["guidellm"].values(), *result["aiperf"].values()]
    result["all_clean"] = all(r.get("failed") == 0 and r.get("exact_lengths") for r in runs)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
