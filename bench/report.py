"""Results on disk: a JSON file per suite, a Markdown table, PNG plots, and the generated part of
docs/results.md (every GPU's check stages and suite tables, between two markers).

Everything here reads what a run wrote; nothing types a figure by hand. Providers named
``fused_remat-<variant>`` (the block's remat policies, say) are ours too, never peers. A case whose
params name a ``baseline`` provider gets each other provider's time and peak memory as ratios to it.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from bench.harness import REPO, RESULTS, Result, device_folder
from fused_remat.training.reporting import pyplot, save_figure

RESULTS_PAGE = REPO / "docs" / "results.md"
OURS = "fused_remat"


def write_facts(folder: Path, name: str, payload: dict, table: str) -> None:
    """A no-GPU command's results: ``<name>.json`` (the payload) and ``<name>.md`` (the table, also printed)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (folder / f"{name}.md").write_text(table)
    print(table)


def write_json(folder: Path, suite: str, environment: dict, ceilings: dict, results: list[Result]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{suite}.json"
    payload = {"suite": suite, "environment": environment, "ceilings": ceilings, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def load_json(path: Path) -> tuple[dict, list[Result]]:
    payload = json.loads(path.read_text())
    return payload, [Result(**row) for row in payload["results"]]


def is_ours(provider: str) -> bool:
    return provider == OURS or provider.startswith(OURS + "-")


def _ceiling_value(unit: str, ceilings: dict) -> float | None:
    """The measured ceiling of a rate in ``unit``; none for units without one (tokens/s)."""
    return {"GB/s": ceilings.get("copy_GBps"), "TFLOP/s": ceilings.get("bf16_matmul_TFLOPs")}.get(unit)


def _cell(result: Result, ceilings: dict, baseline: Result | None = None) -> str:
    if result.error:
        return result.error
    if result.ms is None and "cell" in result.extra:  # not a timing: the suite wrote the cell (train's longest sequence)
        return result.extra["cell"]
    text = f"{result.metric:,.1f} ({result.ms:.3f} ms)" if result.metric is not None else f"{result.ms:.3f} ms"
    ceiling = _ceiling_value(result.unit, ceilings)
    if is_ours(result.provider) and ceiling and result.metric is not None:
        text += f", {100 * result.metric / ceiling:.0f}% of peak"
    if "host_ms" in result.extra:
        text += f", host {result.extra['host_ms']:.3f} ms"
    if result.peak_mib is not None:
        text += f", peak {result.peak_mib:,.0f} MiB"
    if result.saved_mib is not None:
        text += f", saved {result.saved_mib:,.1f} MiB"
    if baseline is not None and baseline is not result and baseline.ms:
        text += f"; vs {baseline.provider}: time {result.ms / baseline.ms:.2f}x"
        if result.peak_mib is not None and baseline.peak_mib:
            text += f", peak {result.peak_mib / baseline.peak_mib:.2f}x"
    return text


def markdown_table(suite: str, environment: dict, ceilings: dict, results: list[Result]) -> str:
    by_case: dict[str, dict[str, Result]] = defaultdict(dict)
    for result in results:
        by_case[result.case][result.provider] = result
    providers = sorted({r.provider for r in results}, key=lambda p: (not is_ours(p), p != OURS, p))
    unit = results[0].unit if results else ""
    ceiling_note = ", ".join(f"{k} {v:,.0f}" for k, v in ceilings.items())
    lines = [
        f"**{suite}** on {environment['device']} (torch {environment['torch']}, triton {environment['triton']}, "
        f"CUDA {environment['cuda']}, {environment['date']}, commit {environment['commit']}); "
        f"measured ceilings: {ceiling_note or 'n/a'}. Cells: {unit} (median ms); last column: best peer's time / ours (>1: we are faster)"
        + ("; 'host': the host's time per call, issued without waiting (near the median: host-bound)"
           if any("host_ms" in r.extra for r in results) else "")
        + ("; 'vs X': time and peak memory over the baseline X's (<1: less)." if any("baseline" in r.params for r in results) else "."),
        "",
        "| case | " + " | ".join(providers) + " | speed-up vs best peer |",
        "|---" * (len(providers) + 2) + "|",
    ]
    for case, row in by_case.items():
        baseline = row.get(next(iter(row.values())).params.get("baseline", ""))
        cells = [_cell(row[p], ceilings, baseline) if p in row else "" for p in providers]
        ours = row.get(OURS)
        peers = [r for p, r in row.items() if not is_ours(p) and r.ms is not None]
        ratio = f"{min(r.ms for r in peers) / ours.ms:.2f}x" if ours and ours.ms and peers else ""
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def write_markdown(folder: Path, suite: str, environment: dict, ceilings: dict, results: list[Result]) -> Path:
    path = folder / f"{suite}.md"
    path.write_text(markdown_table(suite, environment, ceilings, results))
    return path


def _series(results: list[Result], x_key: str, group_keys: tuple[str, ...], value):
    """{group: {provider: ([x], [y])}} for successful results, sorted by x."""
    series: dict[tuple, dict[str, tuple[list, list]]] = defaultdict(lambda: defaultdict(lambda: ([], [])))
    for result in sorted(results, key=lambda r: r.params.get(x_key, 0)):
        y = value(result)
        if y is None:
            continue
        group = tuple(result.params.get(k) for k in group_keys)
        xs, ys = series[group][result.provider]
        xs.append(result.params[x_key])
        ys.append(y)
    return series


def shared_params(results: list[Result], skip: tuple[str, ...] = ()) -> str:
    """The params every result has with the same value ("dtype=bfloat16, tokens=16384"), for a
    figure's title: what the data says was measured, not what a caller typed."""
    if not results:
        return ""
    common = {k: v for k, v in results[0].params.items() if k not in skip and isinstance(v, (str, int, float))}
    for result in results[1:]:
        common = {k: v for k, v in common.items() if result.params.get(k) == v}
    return ", ".join(f"{k}={v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k}={v}"
                     for k, v in common.items())


# Providers drawn on one axis get a marker and a line style each, so that lines lying on top of each
# other (equal timings, equal bytes) stay distinguishable.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINESTYLES = ("-", "--", "-.", ":")


def plot(folder: Path, name: str, title: str, results: list[Result], x_key: str, group_keys: tuple[str, ...],
         value, ylabel: str, ceiling: float | None = None, log_y: bool = False) -> Path | None:
    """One subplot per group, one line per provider; returns the PNG's path (None without matplotlib).
    The title gets a second line with the params all results share; points of a search that
    stopped at its limit (``extra["at_limit"]``) are ringed and labelled ">=". Nothing is clipped."""
    plt = pyplot()
    if plt is None:
        return None
    series = _series(results, x_key, group_keys, value)
    if not series:
        return None
    capped = {(r.provider, r.params.get(x_key)) for r in results if r.extra.get("at_limit")}
    columns = min(3, len(series))
    rows = -(-len(series) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), squeeze=False, layout="constrained")
    providers = sorted({p for lines in series.values() for p in lines}, key=lambda p: (p != OURS, p))
    for ax, (group, lines) in zip(axes.flat, sorted(series.items(), key=lambda item: str(item[0]))):
        for provider, (xs, ys) in sorted(lines.items(), key=lambda item: item[0] != OURS):
            index = providers.index(provider)
            ax.plot(xs, ys, marker=_MARKERS[index % len(_MARKERS)], linestyle=_LINESTYLES[index % len(_LINESTYLES)],
                    markersize=7 - index % 3, alpha=0.85, linewidth=2.5 if provider == OURS else 1.2, label=provider)
            for x, y in zip(xs, ys):
                if (provider, x) in capped:
                    ax.plot([x], [y], marker="o", markersize=13, markerfacecolor="none", color="black")
                    ax.annotate(">= (search limit)", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
        if ceiling:
            ax.axhline(ceiling, color="gray", linestyle="--", label="measured ceiling")
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(group_keys, group)), fontsize=9)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(x_key)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(series):]:
        ax.set_visible(False)
    measured = shared_params(results, skip=(x_key, *group_keys))
    fig.suptitle(title + (f"\n{measured}" if measured else ""), fontsize=10, wrap=True)
    return save_figure(fig, folder / f"{name}.png")


# docs/results.md's generated part lies between these two lines; the rest of the page is written
# by hand and left alone.
MARK_START, MARK_END = "<!-- results:start -->", "<!-- results:end -->"
# bench/results/static/ holds `python -m bench static`'s compile-time facts (static.json, static.md),
# bench/results/frontier/ `python -m bench frontier`'s bytes and FLOPs (frontier.json, .md, .png),
# bench/results/checkpoint/ `python -m bench checkpoint`'s save/load on CPU ranks (checkpoint.json, .md),
# bench/results/host/ and bench/results/peak/ the host time and the memory measured on a CPU:
# never kernel speed, so never in the generated tables, which are rebuilt from GPU timings alone. A
# folder named for one of them and a variant (static-triton3.6: the same compile on another Triton)
# is one of them too.
NOT_TIMINGS = ("static", "frontier", "checkpoint", "host", "peak", "context_parallel", "traffic")


def holds_timings(folder: Path) -> bool:
    """Whether ``folder`` (under bench/results/) holds a GPU's timings rather than NOT_TIMINGS' facts."""
    return folder.is_dir() and folder.name.split("-", 1)[0] not in NOT_TIMINGS


def suite_files(folder: Path) -> list[Path]:
    """The benchmark suites' JSON in ``folder``, without bench/gpu_check.sh's stage records beside them."""
    return sorted(set(folder.glob("*.json")) - set(folder.glob("gpu_check_*.json")))


def results_section(results_dir: Path = RESULTS, page_dir: Path = RESULTS_PAGE.parent) -> str:
    """docs/results.md's generated part, rebuilt from the committed JSON files: per GPU, the stages of
    bench/gpu_check.sh (gpu_check_*.json), then each benchmark suite's table and plots. The plots are
    linked relative to ``page_dir``, the folder of the page that shows them."""
    parts = []
    for folder in sorted(filter(holds_timings, results_dir.glob("*"))):
        stages = [json.loads(path.read_text()) for path in sorted(folder.glob("gpu_check_*.json"))]
        if stages:
            parts.append(gpu_check_table(folder.name, stages))
        for path in suite_files(folder):
            payload, results = load_json(path)
            parts.append(markdown_table(payload["suite"], payload["environment"], payload["ceilings"], results))
            for png in sorted(folder.glob(f"{payload['suite']}*.png")):
                parts.append(f"![{png.stem}]({Path(os.path.relpath(png, page_dir)).as_posix()})\n")
    if not parts:
        return "Not yet measured: no GPU run has been recorded. Kernel speed is only ever reported from a GPU run.\n"
    return "Generated by `python -m bench results` from `bench/results/`.\n\n" + "\n".join(parts)


def gpu_check_table(gpu: str, stages: list[dict]) -> str:
    """One row per stage of bench/gpu_check.sh on ``gpu``: its exit, time and summary's last line."""
    first = stages[0]["environment"]
    lines = [f"**GPU check on {first['device']}** (driver {first.get('driver')}, torch {first['torch']}, Triton "
             f"{first['triton']}, CUDA {first['cuda']}, commit {first['commit']}; bench/gpu_check.sh, logs in "
             f"bench/results/{gpu}/)", "", "| stage | exit | seconds | last line |", "|---|---|---:|---|"]
    order = ("install", "tests", "bench", "train", "capacity")
    for stage in sorted(stages, key=lambda s: order.index(s["stage"]) if s["stage"] in order else len(order)):
        verdict = "timed out" if stage["timed_out"] else str(stage["exit"])
        last = stage["summary"][-1] if stage["summary"] else ""
        lines.append(f"| {stage['stage']} | {verdict} | {stage['seconds']} | {last.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def update_results_page(page: Path = RESULTS_PAGE, results_dir: Path = RESULTS) -> Path:
    """Rewrite what lies between ``page``'s MARK_START and MARK_END with results_section(); the
    rest of the page stays as written. Returns the page."""
    text = page.read_text()
    start, end = text.find(MARK_START), text.find(MARK_END)
    if start < 0 or end < start:
        raise ValueError(f"{page} needs the lines {MARK_START} and then {MARK_END} around its generated tables")
    start += len(MARK_START)
    page.write_text(text[:start] + "\n" + results_section(results_dir, page.parent) + text[end:])
    return page


def summary(folder: Path) -> str:
    """One line per suite of a run: how often ours beat the best peer, and the geometric-mean ratio."""
    lines = ["| suite | cases | ours fastest | geo-mean speed-up vs best peer | range |", "|---|---|---|---|---|"]
    for path in suite_files(folder):
        payload, results = load_json(path)
        ratios = []
        for case in dict.fromkeys(r.case for r in results):
            row = [r for r in results if r.case == case]
            ours = next((r for r in row if r.provider == OURS and r.ms), None)
            peers = [r.ms for r in row if not is_ours(r.provider) and r.ms]
            if ours and peers:
                ratios.append(min(peers) / ours.ms)
        if not ratios:
            lines.append(f"| {payload['suite']} | 0 | | | |")
            continue
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        wins = sum(r >= 1 for r in ratios)
        lines.append(f"| {payload['suite']} | {len(ratios)} | {wins} | {geo:.2f}x | {min(ratios):.2f}x - {max(ratios):.2f}x |")
    return "\n".join(lines)
