"""The evaluation report: PNG plots, `report.md` and a self-contained `report.html`.

    paths = write_plots(out_dir / "plots", flat_metrics, rows)
    write_report(out_dir, flat_metrics, plots=paths, header={"model": "outputs/train/final"})

Every number in the report is a value of the flat metrics dict, printed exactly as
`metrics.json` holds it (`format_value`), so the report and the DVC metrics never disagree.
Plots (matplotlib Agg):
- `prompt_tokens_by_turn.png`: mean prompt tokens at each turn, memory vs full-context (and
  the other multi-turn agents), on the benchmark with the most objectives;
- `em_vs_k.png` and `peak_prompt_tokens_vs_k.png`: over the `world-k*` benchmarks (`world`
  stands for k = 1 when `world-k1` was not evaluated);
- `em_by_benchmark.png`: EM per benchmark, one bar per agent.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mempo.evaluation.benchmarks import objectives_k
from mempo.evaluation.metrics import MEAN_METRICS, nested, prompt_tokens_by_turn
from mempo.io import atomic_path, write_text

# Column order of the per-benchmark tables; anything else found in the metrics follows.
TABLE_METRICS = ("n", *MEAN_METRICS[:9], "peak_prompt_tokens_max", *MEAN_METRICS[9:])
MULTI_TURN_AGENTS = ("memory", "full_context", "external_memory")
AGENT_ORDER = ("memory", "full_context", "external_memory", "rag", "direct")


def format_value(value: float | int) -> str:
    """A metric as text, identical to its JSON form in metrics.json (`0.5`, `12`, `0.4123`)."""
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def _ordered(names: Sequence[str], order: Sequence[str]) -> list[str]:
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def _bench_order(benches: Sequence[str]) -> list[str]:
    def key(b: str) -> tuple[int, int, str]:
        k = objectives_k(b)
        return (1, k, b) if k is not None else ((0, 0, b) if b != "world" else (1, 0, b))

    return sorted(benches, key=key)


def _axis_setup() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    return path


def write_plots(
    plots_dir: str | Path,
    flat: Mapping[str, float | int],
    rows: Sequence[Mapping[str, Any]],
) -> dict[str, Path]:
    """Draw the report's plots into `plots_dir`. Returns plot name -> PNG path (only those drawn)."""
    plt = _axis_setup()
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    table = nested(flat)
    agents = _ordered(list(table), AGENT_ORDER)
    benches = _bench_order(sorted({b for a in table.values() for b in a}))
    out: dict[str, Path] = {}

    # Prompt tokens by turn, on the benchmark needing the most turns (largest k).
    turn_agents = [a for a in agents if a in MULTI_TURN_AGENTS]
    if turn_agents and benches:
        bench = max(benches, key=lambda b: (objectives_k(b) or 1, -benches.index(b)))
        fig, ax = plt.subplots(figsize=(6.4, 4))
        drawn = False
        for agent in turn_agents:
            series = prompt_tokens_by_turn(r for r in rows if r["agent"] == agent and r["benchmark"] == bench)
            if series:
                ax.plot([t + 1 for t in series], list(series.values()), marker="o", label=agent)
                drawn = True
        if drawn:
            ax.set_xlabel("turn")
            ax.set_ylabel("mean prompt tokens")
            ax.set_title(f"Prompt tokens by turn ({bench})")
            ax.grid(alpha=0.3)
            ax.legend()
            out["prompt_tokens_by_turn"] = _save(fig, plots_dir / "prompt_tokens_by_turn.png")
        plt.close(fig)

    # EM and peak prompt tokens against the number of objectives k.
    k_benches = sorted((objectives_k(b), b) for b in benches if objectives_k(b) is not None)
    # Without world-k1, the plain `world` set (the same test questions, one objective each) is k = 1.
    if "world" in benches and k_benches and all(k != 1 for k, _ in k_benches):
        k_benches.insert(0, (1, "world"))
    if len(k_benches) >= 2:
        for metric, fname, ylabel in (
            ("em", "em_vs_k", "EM (all objectives correct)"),
            ("peak_prompt_tokens", "peak_prompt_tokens_vs_k", "mean peak prompt tokens"),
        ):
            fig, ax = plt.subplots(figsize=(6.4, 4))
            for agent in agents:
                pts = [(k, table[agent][b][metric]) for k, b in k_benches if metric in table[agent].get(b, {})]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=agent)
            ax.set_xscale("log", base=2)
            ax.set_xticks([k for k, _ in k_benches], [str(k) for k, _ in k_benches])
            ax.set_xlabel("objectives per task (k)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel} vs k")
            ax.grid(alpha=0.3)
            ax.legend()
            out[fname] = _save(fig, plots_dir / f"{fname}.png")
            plt.close(fig)

    # EM per benchmark, grouped bars.
    if agents and benches:
        fig, ax = plt.subplots(figsize=(max(6.4, 1.2 * len(benches) + 2), 4))
        width = 0.8 / len(agents)
        for i, agent in enumerate(agents):
            vals = [table[agent].get(b, {}).get("em", 0.0) for b in benches]
            xs = [j + (i - (len(agents) - 1) / 2) * width for j in range(len(benches))]
            ax.bar(xs, vals, width=width, label=agent)
        ax.set_xticks(range(len(benches)), benches, rotation=30, ha="right")
        ax.set_ylabel("EM")
        ax.set_ylim(0, 1)
        ax.set_title("EM by benchmark")
        ax.legend(fontsize="small")
        out["em_by_benchmark"] = _save(fig, plots_dir / "em_by_benchmark.png")
        plt.close(fig)
    return out


def _md_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def render_markdown(
    flat: Mapping[str, float | int],
    *,
    header: Mapping[str, Any] | None = None,
    plots: Mapping[str, Path] | None = None,
    plots_rel: str = "plots",
) -> str:
    """The report as Markdown: run facts, an EM summary, one full table per benchmark, plots.

    The per-benchmark tables hold every key of `flat` exactly once (rows: agents; columns:
    metrics), so `parse_report_tables` recovers `flat` from the text.
    """
    table = nested(flat)
    agents = _ordered(list(table), AGENT_ORDER)
    benches = _bench_order(sorted({b for a in table.values() for b in a}))
    lines = ["# MemPO evaluation report", ""]
    if header:
        for k, v in header.items():
            lines.append(f"- **{k}**: `{v}`")
        lines.append("")
    lines += ["## EM by agent and benchmark", ""]
    lines += _md_table(
        ["agent", *benches],
        [[a, *(format_value(table[a][b]["em"]) if "em" in table[a].get(b, {}) else "–" for b in benches)]
         for a in agents],
    )
    lines.append("")
    for bench in benches:
        present = {m for a in agents for m in table[a].get(bench, {})}
        cols = [m for m in TABLE_METRICS if m in present] + sorted(present - set(TABLE_METRICS))
        k = objectives_k(bench)
        lines += [f"## {bench}" + (f" (k = {k})" if k else ""), ""]
        lines += _md_table(
            ["agent", *cols],
            [[a, *(format_value(table[a][bench][m]) if m in table[a].get(bench, {}) else "–" for m in cols)]
             for a in agents if bench in table[a]],
        )
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for name, path in plots.items():
            lines += [f"![{name}]({plots_rel}/{Path(path).name})", ""]
    lines += [
        "Metrics: means over samples (rates for 0/1 columns); `peak_prompt_tokens` is the mean "
        "per-episode peak, `peak_prompt_tokens_max` the largest; truncated episodes (prompt over "
        "the context window) are scored as wrong. Per-sample rows are in `samples.parquet`.",
        "",
    ]
    return "\n".join(lines)


def parse_report_tables(markdown_text: str) -> dict[str, str]:
    """Read back the per-benchmark tables: `{"agent/bench/metric": "text as printed"}`."""
    out: dict[str, str] = {}
    bench: str | None = None
    header: list[str] | None = None
    for line in markdown_text.splitlines():
        m = re.match(r"^## (\S+)(?: \(k = \d+\))?$", line)
        if m:
            bench = None if m.group(1) in ("EM", "Plots") else m.group(1)
            header = None
            continue
        if bench is None or not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        for metric, cell in zip(header[1:], cells[1:], strict=True):
            if cell != "–":
                out[f"{cells[0]}/{bench}/{metric}"] = cell
    return out


def render_html(markdown_text: str, base_dir: str | Path) -> str:
    """Markdown -> one self-contained HTML page (plots embedded as data URIs)."""
    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables"])
    base_dir = Path(base_dir)

    def embed(m: re.Match[str]) -> str:
        src = html.unescape(m.group(1))
        p = base_dir / src
        if not p.is_file():
            return m.group(0)
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        return f'src="data:image/png;base64,{data}"'

    body = re.sub(r'src="([^"]+\.png)"', embed, body)
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}"
        "th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th:first-child,td:first-child{text-align:left}img{max-width:100%}"
    )
    return (
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>MemPO evaluation report</title>"
        f"<style>{style}</style></head><body>\n{body}\n</body></html>\n"
    )


def write_report(
    out_dir: str | Path,
    flat: Mapping[str, float | int],
    *,
    header: Mapping[str, Any] | None = None,
    plots: Mapping[str, Path] | None = None,
) -> tuple[Path, Path]:
    """Write `out_dir/report.md` and `out_dir/report.html`. Returns both paths."""
    out_dir = Path(out_dir)
    md = render_markdown(flat, header=header, plots=plots)
    md_path = write_text(out_dir / "report.md", md)
    html_path = write_text(out_dir / "report.html", render_html(md, out_dir))
    return md_path, html_path
