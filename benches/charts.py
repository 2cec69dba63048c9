"""One PNG per scenario of the side-by-side suite: throughput by server and client, p99 on top
(p50 latency for a scenario measured only in latency, such as the cold load)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["write_charts"]


def write_charts(figures: list[dict[str, Any]], directory: Path) -> list[Path]:
    """Write `<scenario>.png` for each scenario into `directory`; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    by_scenario: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in figures:
        by_scenario[f["scenario"]].append(f)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for scenario, rows in by_scenario.items():
        servers = list(dict.fromkeys(r["server"] for r in rows))
        clients = list(dict.fromkeys(r["client"] for r in rows))
        metric = "throughput" if any(r["throughput"] for r in rows) else "p50_ms"
        width = 0.8 / len(clients)
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for k, client in enumerate(clients):
            for i, server in enumerate(servers):
                row = next((r for r in rows if r["server"] == server and r["client"] == client), None)
                x = i + (k - (len(clients) - 1) / 2) * width
                if row is None or row["throughput"] is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                    continue
                ax.bar(x, row["throughput"], width, label=client if i == 0 else None, color=f"C{k}")
                if row["p99_ms"] is not None:
                    ax.text(
                        x, row["throughput"], f"p99 {row['p99_ms']:.1f}", ha="center", va="bottom", fontsize=7
                    )
        ax.set_xticks(range(len(servers)), servers)
        ax.set_ylabel("inferences / s" if metric == "throughput" else "p50 latency, ms")
        ax.set_title(scenario)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = directory / (scenario.replace(" ", "_").replace("/", "-").replace("=", "") + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
