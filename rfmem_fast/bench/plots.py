"""PNG plots of a benchmark document (matplotlib, Agg canvas, no pyplot global state).

* ``<stem>-latency.png``: p50 latency (solid lines; p99 dotted) against
  the memory scale in tokens, one panel per mode, one line per system.
* ``<stem>-throughput.png``: queries per second against the batch size, one panel per
  shared-bank size, one line per (system, mode); the reference's per-query loop as a
  dashed horizontal line; plus a bar panel of the multi-tenant batch.
"""
from __future__ import annotations

from pathlib import Path

from .report import record_label
from typing import Any

_STYLE = {"dense": "-", "recollection": ":", "rfmem": "--"}
_MARK = {"ours": "o", "faiss": "s", "reference": "x"}


def _null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _figure(n_panels: int, width: float = 4.6, height: float = 3.8):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * n_panels, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, n_panels, i + 1) for i in range(n_panels)]
    return fig, axes


def _label(rec: dict[str, Any]) -> str:
    if rec["kind"] == "reference":
        return "reference loop"
    if "dtype" in rec or "threads" in rec:  # rfmem bench's records: the variant's name
        return record_label(rec)
    return rec.get("label") or {"faiss": "faiss IndexFlatIP"}.get(rec["kind"], rec["system"])


def _key(rec: dict[str, Any]) -> str:
    """The system variant a record belongs to (one line / bar group per variant)."""
    return rec.get("label", rec["system"])


def plot_latency(doc: dict[str, Any], path: str | Path) -> Path | None:
    """p50 / p99 latency vs memory scale per mode.

    Args:
        doc: the benchmark document.
        path: PNG file to write.

    Returns:
        the path, or None when the latency workload did not run.
    """
    lat = (doc.get("workloads") or {}).get("latency") or {}
    scales = lat.get("scales") or []
    if not scales:
        return None
    modes = [m for m in ("dense", "recollection", "rfmem") if any(r["mode"] == m for s in scales for r in s["results"])]
    fig, axes = _figure(len(modes))
    for ax, mode in zip(axes, modes):
        systems = []
        for s in scales:
            for r in s["results"]:
                if r["mode"] == mode and (r["kind"], _key(r)) not in [(k, _key(x)) for k, x in systems]:
                    systems.append((r["kind"], r))
        for kind, first in systems:
            xs, p50, p99 = [], [], []
            for s in scales:
                r = next((r for r in s["results"] if _key(r) == _key(first) and r["mode"] == mode), None)
                if r and r.get("p50_ms"):
                    xs.append(s["tokens"])
                    p50.append(r["p50_ms"])
                    p99.append(r["p99_ms"])
            if not xs:
                continue
            line = ax.plot(xs, p50, marker=_MARK.get(kind, "o"), label=_label(first))[0]
            ax.plot(xs, p99, ls=":", lw=1, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([s["tokens"] for s in scales], [s["scale"] for s in scales])
        ax.xaxis.set_minor_locator(_null_locator())
        ax.set_xlabel(f"memory (tokens; {lat['chunk_tokens']} per chunk)")
        ax.set_ylabel("ms per query (p50 solid, p99 dotted)")
        ax.set_title(mode)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_subtitle(doc, "Single-query latency vs memory scale"), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def plot_throughput(doc: dict[str, Any], path: str | Path) -> Path | None:
    """Queries per second vs batch size per backend (shared banks) and the multi-tenant batch.

    Args:
        doc: the benchmark document.
        path: PNG file to write.

    Returns:
        the path, or None when neither throughput workload ran.
    """
    w = doc.get("workloads") or {}
    bat = w.get("batch") or {}
    sizes = bat.get("sizes") or []
    mt = w.get("multitenant") or {}
    has_mt = bool(mt.get("results"))
    if not sizes and not has_mt:
        return None
    fig, axes = _figure(len(sizes) + (1 if has_mt else 0))
    for ax, sz in zip(axes, sizes):
        keys = []
        for r in sz["results"]:
            if (r["kind"], _key(r), r["mode"]) not in keys:
                keys.append((r["kind"], _key(r), r["mode"]))
        bss = sorted(bat["batch_sizes"])
        for kind, system, mode in keys:
            rs = [r for r in sz["results"] if _key(r) == system and r["mode"] == mode and r.get("qps")]
            if not rs:
                continue
            lab = f"{_label(rs[0])} {mode}"
            if kind == "reference":
                ax.axhline(rs[0]["qps"], ls="--", lw=1, color="grey" if mode == "dense" else "black", label=lab)
                continue
            rs = sorted(rs, key=lambda r: r["batch_size"])
            ax.plot([r["batch_size"] for r in rs], [r["qps"] for r in rs], ls=_STYLE.get(mode, "-"),
                    marker=_MARK.get(kind, "o"), label=lab)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(bss, [str(b) for b in bss])
        ax.xaxis.set_minor_locator(_null_locator())
        ax.set_xlabel("batch size")
        ax.set_ylabel("queries per second")
        ax.set_title(f"shared bank, {sz['n']:,} vectors")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if has_mt:
        ax = axes[-1]
        recs = mt["results"]
        labels = [f"{_label(r)}\n{r['mode']}" for r in recs]
        ax.bar(range(len(recs)), [r["qps"] for r in recs], color=[{"ours": "C0", "faiss": "C1"}.get(r["kind"], "C7") for r in recs])
        ax.set_xticks(range(len(recs)), labels, rotation=60, fontsize=6, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("queries per second")
        ax.set_title(f"multi-tenant {mt['users']} x {mt['items']}, batch {mt['batch_size']}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(_subtitle(doc, "Throughput"), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def _subtitle(doc: dict[str, Any], what: str) -> str:
    m = doc.get("machine") or {}
    dev = m.get("gpu") or f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
    return f"{what} - rfmem_fast {doc.get('versions', {}).get('rfmem_fast', '')}, {dev}"


def write_plots(doc: dict[str, Any], json_path: str | Path) -> list[Path]:
    """Write the PNGs next to the JSON file (``<stem>-latency.png``, ``<stem>-throughput.png``).

    Returns:
        the paths written (a plot whose workload did not run is skipped).
    """
    p = Path(json_path)
    stem = p.with_suffix("")
    out = []
    for fn, suffix in ((plot_latency, "-latency.png"), (plot_throughput, "-throughput.png")):
        q = fn(doc, f"{stem}{suffix}")
        if q is not None:
            out.append(q)
    return out
