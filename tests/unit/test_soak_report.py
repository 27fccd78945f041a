"""scripts/soak.py's late RSS slope: what tells a leak (growth to the end) from a one-time step in a soak report."""

from scripts.soak import late_slope


def _series(rss_by_done: list[tuple[int, float]]) -> list[dict]:
    rows = [{"t": 0.0, "done": 0, "rss_mib": {"0": 100.0}, "label": "start"}]
    for i, (done, mib) in enumerate(rss_by_done):
        row = {"t": float(i + 1), "done": done, "rss_mib": {"0": mib}}
        if i == 0:
            row["label"] = "baseline"
        rows.append(row)
    return rows


def test_a_steady_leak_keeps_its_slope_to_the_end():
    leak = _series([(1000 * k, 200.0 + 2.0 * k) for k in range(1, 11)])  # 2 MiB per 1,000 requests
    assert late_slope(leak) == {"0": 2.0}


def test_a_one_time_step_early_after_the_baseline_leaves_no_late_slope():
    step = _series([(1000 * k, 200.0 if k < 3 else 250.0) for k in range(1, 11)])
    assert late_slope(step) == {"0": 0.0}


def test_too_few_samples_after_the_baseline_give_nothing():
    assert late_slope(_series([(1000, 200.0), (2000, 201.0)])) == {}
