"""Two hosts with their own addresses (network namespaces joined by a veth pair) and a mix of transports:
shared memory between the ranks of one host, Mooncake between hosts (docs/architecture.md §7, §11).

node-a runs a prefill replica (rank 0); node-b runs the decode rank (1) and another prefill replica (2). A request
prefilled on rank 0 sends its KV cache across hosts (mooncake), one prefilled on rank 2 within node-b (shm). Each
host's ``env`` in the cluster spec sets its GLOO_SOCKET_IFNAME: without it the world's gloo group cannot form.

A failure means per-host env is not applied before a rank initialises, the transport is not chosen by the
consumer's host, a transport changes what the model says (pinned requests must give the P/D p2p text), or
Mooncake cannot run between hosts with distinct addresses.
"""

from __future__ import annotations

import json

import pytest

from tests.dist.transport_rig import mooncake_available
from tests.e2e.netns import NetnsPair
from tests.e2e.server import REPO, Server
from tests.e2e.test_transports_pd import REFERENCE, pinned_texts  # runs after that module: its p2p texts

pytestmark = [
    pytest.mark.skipif(NetnsPair.unavailable() is not None, reason=f"no network namespaces: {NetnsPair.unavailable()}"),
    pytest.mark.skipif(mooncake_available() is not None, reason=f"no Mooncake: {mooncake_available()}"),
]

CLIENT = """
import json, re, httpx
from tests.e2e.server import wait_for
from tests.e2e.test_transports_pd import pinned_texts
base = "{base}"
texts = pinned_texts(base)
for i in range(10):  # more requests: both prefill replicas get some (prompts long enough not to go inline)
    r = httpx.post(base + "/generate", timeout=120, json={{"prompt": "Tell me about the sea, the wind and the " * 3,
                                                            "model_kwargs": {{"max_tokens": 2, "seed": i}}}})
    assert r.status_code == 200, r.text
def both_edges():  # per-edge statistics arrive with the gauges (every 0.5 s): until both KV edges are there
    text = httpx.get(base + "/metrics", timeout=10).text
    return text if all(re.search(r'^mstar_dist_edge_transfers_total{{[^}}]*src="' + src + '",transport="' + via + '"',
                                 text, re.M) for src, via in (("0", "mooncake"), ("2", "shm"))) else None
print(json.dumps({{"texts": texts, "metrics": wait_for(both_edges, 15, "the KV edges 0 -> 1 and 2 -> 1 in /metrics")}}))
"""


def config(rig: NetnsPair) -> dict:
    return {
        "node_groups": [
            {"node_names": ["LLM"], "ranks": [0, 2], "graph_walks": ["prefill"], "cpu_threads": 1},
            {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"], "cpu_threads": 1},
        ],
        "cluster": {"hosts": [
            {"name": "node-a", "addr": rig.addrs[0], "devices": [0], "env": {"GLOO_SOCKET_IFNAME": rig.ifnames[0]}},
            {"name": "node-b", "addr": rig.addrs[1], "devices": [0, 1],
             "env": {"GLOO_SOCKET_IFNAME": rig.ifnames[1]}},
        ]},
        "transport": {"intra_host": "shm", "inter_host": "mooncake"},
    }


def reference() -> list[str]:
    """The P/D deployment's pinned texts over p2p on one host (from test_transports_pd when it ran)."""
    if "texts" not in REFERENCE:
        server = Server(REPO / "launch/configs/smollm2_pd.yaml", nproc=2)
        try:
            REFERENCE["texts"] = pinned_texts(server.base_url)
        finally:
            server.stop()
    return REFERENCE["texts"]


def test_shm_within_a_host_and_mooncake_between_hosts_give_the_p2p_text():
    expected = reference()
    with NetnsPair() as rig:
        server = Server(REPO / "launch/configs/smollm2_pd.yaml", 0, nodes=[1, 2], overrides=config(rig), netns=rig)
        try:
            out = json.loads(rig.run_in(0, CLIENT.format(base=server.base_url)))
        finally:
            server.stop()
        log = server.log_path.read_text(errors="replace")
    assert out["texts"] == expected
    edges = [line for line in out["metrics"].splitlines() if line.startswith("mstar_dist_edge_transfers_total")]
    used = {(line.split('src="')[1][0], line.split('transport="')[1].split('"')[0]) for line in edges}
    assert {("0", "mooncake"), ("2", "shm")} <= used, edges  # KV 0 -> 1 across hosts, 2 -> 1 within node-b
    assert not used & {("0", "shm"), ("2", "mooncake")}, edges
    assert "node-a -> node-b: 1 rank pair(s) via mooncake" in log
    assert f"environment {{'GLOO_SOCKET_IFNAME': '{rig.ifnames[1]}'}}" in log
