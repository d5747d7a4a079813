"""The evaluation report: PNG plots, `report.md` and a self-contained `report.html`.

    paths = write_plots(out_dir / "plots", flat_metrics, rows)
    write_report(out_dir, flat_metrics, plots=paths, header={"model": "outputs/train/final"})

Every number in the report is a value of the flat metrics dict, rounded for reading
(`format_value`: rates to 3 places, token and turn counts to 1, latencies to 2), so the report
and `metrics.json` never disagree beyond that rounding. The first table compares the trained
policies, each run in the format it was trained for; agents run on a policy trained for
another format (e.g. `rag` on the memory policy) are listed apart, as cross-format rows. Each
benchmark then gets a quality and a cost table, and the report ends with one example episode
per agent and k, the same task for every agent, with the memory turn by turn.
Plots (matplotlib Agg):
- `prompt_tokens_by_turn.png`: mean prompt tokens at each turn, memory vs full-context (and
  the other multi-turn agents), on the benchmark with the most objectives;
- `em_vs_k.png` and `peak_prompt_tokens_vs_k.png`: over the `world-k*` benchmarks (`world`
  stands for k = 1 when `world-k1` was not evaluated);
- `em_by_benchmark.png`: EM per benchmark, one bar per agent;
- `outcomes.png`: how the episodes of each agent and benchmark ended (`mempo.evaluation.outcomes`:
  correct, partly correct, wrong, wrong number of answers, no answer, turn limit, context limit),
  also a table in the report.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mempo.evaluation.benchmarks import objectives_k
from mempo.evaluation.metrics import nested, prompt_tokens_by_turn
from mempo.evaluation.outcomes import OUTCOMES, outcome_shares
from mempo.io import atomic_path, write_text

# The per-benchmark tables: answer quality, then cost; anything else found follows in the cost table.
QUALITY_METRICS = ("n", "em", "f1", "substring_em", "objective_em", "all_correct", "format_valid",
                   "forgetting_rate", "forgetting_rate_seen", "memory_probe")
COST_METRICS = ("turns", "searches", "peak_prompt_tokens", "peak_prompt_tokens_max", "total_prompt_tokens",
                "generated_tokens", "repeated_turns", "latency_s", "truncated")
TABLE_METRICS = QUALITY_METRICS + COST_METRICS
MULTI_TURN_AGENTS = ("memory", "full_context", "external_memory")
AGENT_ORDER = ("memory", "full_context", "external_memory", "rag", "direct")
OUTCOME_COLORS = {"correct": "#2e7d32", "partly correct": "#9ccc65", "wrong": "#e57373", "wrong count": "#ffb74d",
                  "no answer": "#90a4ae", "turn limit": "#7e57c2", "context limit": "#424242"}
# Metrics that are rates in [0, 1] (printed to 3 places); latencies to 2; counts to 1.
RATE_METRICS = frozenset({"em", "f1", "substring_em", "objective_em", "all_correct", "format_valid",
                          "forgetting_rate", "forgetting_rate_seen", "memory_probe", "truncated",
                          "hit_turn_limit"})
_SHORT = {"substring_em": "sub-EM", "objective_em": "obj EM", "all_correct": "all right",
          "format_valid": "valid", "forgetting_rate": "forget", "forgetting_rate_seen": "forget (seen)",
          "memory_probe": "mem probe", "peak_prompt_tokens": "peak prompt", "peak_prompt_tokens_max": "max peak",
          "total_prompt_tokens": "prompt tokens", "generated_tokens": "generated", "latency_s": "latency s",
          "repeated_turns": "repeats"}


def decimals(metric: str) -> int:
    """Places a metric is printed with in the report."""
    if metric in RATE_METRICS:
        return 3
    return 2 if metric.endswith("_s") else 1


def format_value(value: float | int, metric: str = "em") -> str:
    """A metric as the report prints it: ints as they are, floats rounded (`decimals`)."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int) or float(value).is_integer() and metric not in RATE_METRICS:
        return str(int(value))
    return f"{float(value):.{decimals(metric)}f}"


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

    # How the episodes ended, one stacked bar per (benchmark, agent).
    shares = _outcome_table(rows, agents, benches)
    if shares:
        labels = [f"{b} · {a}" for b, a, _ in shares]
        fig, ax = plt.subplots(figsize=(8, 0.32 * len(shares) + 1.6))
        left = [0.0] * len(shares)
        for outcome in OUTCOMES:
            vals = [s.get(outcome, 0.0) for _, _, s in shares]
            if any(vals):
                ax.barh(range(len(shares)), vals, left=left, color=OUTCOME_COLORS[outcome], label=outcome)
                left = [x + v for x, v in zip(left, vals, strict=True)]
        ax.set_yticks(range(len(shares)), labels, fontsize="small")
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of episodes")
        ax.set_title("How the episodes ended")
        ax.legend(fontsize="small", ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(shares)))
        out["outcomes"] = _save(fig, plots_dir / "outcomes.png")
        plt.close(fig)
    return out


def _outcome_table(rows: Sequence[Mapping[str, Any]] | None, agents: Sequence[str],
                   benches: Sequence[str]) -> list[tuple[str, str, dict[str, float]]]:
    """(benchmark, agent, outcome shares) for every pair with rows, benchmarks in report order."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows or ():
        groups.setdefault((str(r["benchmark"]), str(r["agent"])), []).append(r)
    return [(b, a, outcome_shares(groups[(b, a)])) for b in benches for a in agents if (b, a) in groups]


def _md_table(header: Sequence[str], body: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """A Markdown table; the first `left` columns (text) are left-aligned, the rest (numbers) right."""
    rule = [":---" if i < left else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def _own_format(agent: str, policies: Mapping[str, Mapping[str, Any]] | None) -> bool | None:
    """Whether `agent` ran a policy trained for its own format (None: not known)."""
    info = (policies or {}).get(agent)
    if not info or info.get("trained_context") is None:
        return None
    return info.get("trained_context") == info.get("agent_context")


def _summary_rows(table: Mapping[str, Any], agents: Sequence[str], benches: Sequence[str],
                  policies: Mapping[str, Mapping[str, Any]] | None) -> list[list[str]]:
    big = max(benches, key=lambda b: objectives_k(b) or 1) if benches else None
    rows = []
    for a in agents:
        cells = [a, str((policies or {}).get(a, {}).get("model", ""))]
        cells += [format_value(table[a][b]["em"]) if "em" in table[a].get(b, {}) else "–" for b in benches]
        peak = table[a].get(big, {}).get("peak_prompt_tokens") if big else None
        cells.append(format_value(peak, "peak_prompt_tokens") if peak is not None else "–")
        forget = table[a].get(big, {}).get("forgetting_rate") if big else None
        cells.append(format_value(forget, "forgetting_rate") if forget is not None else "–")
        rows.append(cells)
    return rows


def _example_lines(rows: Sequence[Mapping[str, Any]], agents: Sequence[str], benches: Sequence[str],
                   max_turns: int = 16) -> list[str]:
    """One example episode per (k, agent): the first task of each benchmark, the same for every
    agent, with each turn's memory and action (what the memory kept and what it lost)."""
    lines = ["## Example episodes", "",
             "The first task of each benchmark, as every agent ran it. `memory` is what the turn wrote "
             "into `<mem>`; the next prompt shows only that (memory agent).", ""]
    by_pair: dict[tuple[str, str], Mapping[str, Any]] = {}
    for r in rows:
        by_pair.setdefault((str(r["benchmark"]), str(r["agent"])), r)
    for bench in benches:
        for agent in agents:
            r = by_pair.get((bench, agent))
            if r is None:
                continue
            lines += [f"### {bench} · {agent}", "",
                      f"- question: {_cell(r.get('question'))}",
                      f"- gold: {_cell('; '.join(map(str, r.get('golden_answers') or [])))}",
                      f"- prediction: {_cell(r.get('prediction'))} (EM {format_value(r.get('em', 0.0))})", ""]
            try:
                turns = json.loads(r.get("transcript") or "[]")
            except ValueError:
                turns = []
            body = []
            for i, t in enumerate(turns[:max_turns]):
                action = f"{t.get('action') or '(none)'}: {t.get('argument') or ''}" if t.get("valid", True) else \
                    f"invalid ({t.get('error', '')})"
                body.append([str(i + 1), _cell(t.get("memory")), _cell(action), _cell(", ".join(t.get("titles") or []))])
            if len(turns) > max_turns:
                body.append(["…", f"{len(turns) - max_turns} more turns", "", ""])
            if body:
                lines += _md_table(["turn", "memory", "action", "titles found"], body, left=4) + [""]
    return lines


def _cell(text: Any, limit: int = 400) -> str:
    """Text safe for a Markdown table cell, cut at `limit` characters."""
    s = " ".join(str(text or "").split())
    s = s if len(s) <= limit else s[:limit] + " …"
    # tags in model text and format errors ("no <mem> ... </mem>") must show, not become HTML
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def render_markdown(
    flat: Mapping[str, float | int],
    *,
    header: Mapping[str, Any] | None = None,
    plots: Mapping[str, Path] | None = None,
    plots_rel: str = "plots",
    rows: Sequence[Mapping[str, Any]] | None = None,
    policies: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """The report as Markdown: run facts, the EM table of trained policies (each in its own
    format) and the cross-format rows apart, a quality and a cost table per benchmark, plots,
    and (given `rows`) example episodes.

    The per-benchmark tables hold every key of `flat` exactly once (rows: agents; columns:
    metrics), so `parse_report_tables` recovers `flat` (rounded as printed) from the text.
    `policies`: agent -> {"model", "trained_context", "agent_context"} (eval.json's).
    """
    table = nested(flat)
    agents = _ordered(list(table), AGENT_ORDER)
    benches = _bench_order(sorted({b for a in table.values() for b in a}))
    lines = ["# MemPO evaluation report", ""]
    if header:
        for k, v in header.items():
            lines.append(f"- **{k}**: `{v}`")
        lines.append("")
    big = max(benches, key=lambda b: objectives_k(b) or 1) if benches else ""
    summary_header = ["agent", "policy", *benches, f"peak prompt ({big})", f"forget ({big})"]
    own = [a for a in agents if _own_format(a, policies) is not False]
    cross = [a for a in agents if _own_format(a, policies) is False]
    lines += ["## EM: trained policies, each in its own format", ""]
    lines += _md_table(summary_header, _summary_rows(table, own, benches, policies), left=2)
    lines.append("")
    if cross:
        lines += ["## EM: cross-format rows (the policy was trained for another format)", ""]
        lines += _md_table(summary_header, _summary_rows(table, cross, benches, policies), left=2)
        lines.append("")
    for bench in benches:
        present = {m for a in agents for m in table[a].get(bench, {})}
        k = objectives_k(bench)
        lines += [f"## {bench}" + (f" (k = {k})" if k else ""), ""]
        extra = sorted(present - set(TABLE_METRICS))
        for cols in ([m for m in QUALITY_METRICS if m in present],
                     [m for m in COST_METRICS if m in present] + extra):
            if not cols:
                continue
            lines += _md_table(
                ["agent", *(_SHORT.get(m, m) for m in cols)],
                [[a, *(format_value(table[a][bench][m], m) if m in table[a].get(bench, {}) else "–"
                       for m in cols)] for a in agents if bench in table[a]],
            )
            lines.append("")
    outcomes = _outcome_table(rows, agents, benches)
    if outcomes:
        lines += ["## How the episodes ended", "",
                  "Share of each agent's episodes per outcome (`mempo.evaluation.outcomes`): `wrong count` "
                  "answered with a number of `;`-separated parts other than k, `no answer` ended without "
                  "`<answer>` (an invalid turn or an error), `turn limit` ran out of turns.", ""]
        lines += _md_table(["benchmark", "agent", *OUTCOMES],
                           [[b, a, *(format_value(s.get(o, 0.0)) for o in OUTCOMES)] for b, a, s in outcomes],
                           left=2)
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for name, path in plots.items():
            lines += [f"![{name}]({plots_rel}/{Path(path).name})", ""]
    lines += [
        "Metrics: means over samples (rates for 0/1 columns); `peak prompt` is the mean per-episode "
        "peak of prompt tokens, `max peak` the largest; `forget`: share of k > 1 episodes whose memory "
        "dropped an answer it had stored (`forget (seen)`: an answer seen in a result and not kept); "
        "`repeats`: turns per episode whose prompt the episode had already had (with greedy decoding "
        "these are sampled, see the header); "
        "truncated episodes (prompt over the context window) are scored as wrong. Per-sample rows are in "
        "`samples.parquet`; exact values in `metrics.json`.",
        "",
    ]
    if rows:
        lines += _example_lines(rows, agents, benches)
    return "\n".join(lines)


def parse_report_tables(markdown_text: str) -> dict[str, str]:
    """Read back the per-benchmark tables: `{"agent/bench/metric": "text as printed"}`."""
    out: dict[str, str] = {}
    bench: str | None = None
    header: list[str] | None = None
    long_name = {v: k for k, v in _SHORT.items()}
    for line in markdown_text.splitlines():
        m = re.match(r"^## (\S+)(?: \(k = \d+\))?$", line)
        if m or line.startswith("## "):
            bench = m.group(1) if m and m.group(1) not in ("EM:", "Plots", "Example") else None
            header = None
            continue
        if bench is None or not line.startswith("|") or re.match(r"^\|:?-", line):
            if not line.strip():
                header = None  # a blank line ends a table; the next one has its own header
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [long_name.get(c, c) for c in cells]
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
        "body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0;font-size:0.88em;max-width:100%;display:block;overflow-x:auto}"
        "th,td{border:1px solid #ccc;padding:3px 7px;text-align:right;white-space:nowrap}"
        "th:first-child,td:first-child{text-align:left}img{max-width:100%}"
        "h3+ul+table td,h3+ul+table th{text-align:left;white-space:normal;vertical-align:top}"
        "h3+ul+table td:nth-child(2){min-width:28em}"
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
    rows: Sequence[Mapping[str, Any]] | None = None,
    policies: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[Path, Path]:
    """Write `out_dir/report.md` and `out_dir/report.html`. Returns both paths."""
    out_dir = Path(out_dir)
    md = render_markdown(flat, header=header, plots=plots, rows=rows, policies=policies)
    md_path = write_text(out_dir / "report.md", md)
    html_path = write_text(out_dir / "report.html", render_html(md, out_dir))
    return md_path, html_path
