#!/usr/bin/env python3
"""Renders the metrics sampled by examples/demo.sh (metrics.csv) into the README picture: what the Grafana
dashboard shows for a healthy run. Needs matplotlib (pip install matplotlib).

    python3 examples/plot_metrics.py /tmp/outboxd-demo/metrics.csv examples/demo-metrics.png
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = list(csv.DictReader(open(sys.argv[1])))
t0 = float(rows[0]["t"])
t = [float(r["t"]) - t0 for r in rows]
col = lambda name: [float(r[name]) for r in rows]
published, backlog, lag, inflight = col("published"), col("unpublished"), col("lag_bytes"), col("inflight")
count, total = col("ack_count"), col("ack_sum")
rate = [0.0] + [(published[k] - published[k - 1]) / max(t[k] - t[k - 1], 1e-9) for k in range(1, len(t))]
latency = [None] + [
    1000 * (total[k] - total[k - 1]) / (count[k] - count[k - 1]) if count[k] > count[k - 1] else None
    for k in range(1, len(t))
]

fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True)
fig.suptitle("outboxd during examples/demo.sh (CDC mode, local PostgreSQL 15 + Apache Kafka 4.1.1, 2 cores)")
axes[0][0].plot(t, rate, color="tab:green")
axes[0][0].set_title("throughput (events/s acknowledged)")
axes[0][1].plot(t, backlog, label="unpublished rows")
axes[0][1].plot(t, inflight, label="in flight")
axes[0][1].set_title("backlog")
axes[0][1].legend()
axes[1][0].plot(t, [x / 1024 for x in lag], color="tab:orange")
axes[1][0].set_title("slot lag (KiB)")
axes[1][1].plot(t, latency, "o-", markersize=3, color="tab:purple")
axes[1][1].set_title("commit-to-ack, mean per sample (ms)")
for ax in axes[1]:
    ax.set_xlabel("seconds")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=90)
print("wrote", sys.argv[2])
