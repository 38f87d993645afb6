#!/usr/bin/env python3
"""Draws the README's latency chart from outboxd-bench's steady.csv: commit-to-consumer latency percentiles (the
writer's COMMIT returning to a Kafka consumer receiving the event) against the offered insert rate, CDC and
polling. Needs matplotlib.

    python3 examples/plot_bench.py target/bench/steady.csv examples/bench-latency.png "2026-11-30, 2 cores"
"""
import csv
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = list(csv.DictReader(open(sys.argv[1])))
subtitle = sys.argv[3] if len(sys.argv) > 3 else ""
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
for ax, mode, prefix, what in [
    (axes[0], "cdc", "commit_to_consumer", "CDC: commit to consumer"),
    (axes[1], "poll", "commit_to_consumer", "polling: commit to consumer"),
]:
    data = sorted((int(r["offered"]), r) for r in rows if r["mode"] == mode)
    rates = [rate for rate, _ in data]
    for quantile, style in [("p50", "o-"), ("p99", "s-"), ("p999", "^-")]:
        values = [float(r[f"{prefix}_{quantile}"]) * 1e3 for _, r in data]
        ax.plot(rates, values, style, label=quantile.replace("p999", "p99.9"))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(what)
    ax.set_xlabel("offered insert rate (events/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
axes[0].set_ylabel("latency (ms)")
fig.suptitle(f"outboxd latency vs. load ({subtitle})" if subtitle else "outboxd latency vs. load")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
