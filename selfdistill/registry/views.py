"""Human-readable renderings of registry reads: tables, lineage as text and as a mermaid diagram."""

from __future__ import annotations

from typing import Any

DATA_IDS_SHOWN = 3  # data ids listed per version in text; --json has them all


def verdict_word(gate: dict[str, Any] | None) -> str:
    """PASS / FAIL of a stored gate run or training-gate dict; "-" when there is none."""
    if not gate:
        return "-"
    passed = gate.get("passed", gate.get("promote"))
    if passed is None and isinstance(gate.get("verdict"), dict):
        passed = gate["verdict"].get("promote")
    return "PASS" if passed else "FAIL"


def versions_table(rows: list[dict[str, Any]]) -> str:
    """One line per version: id, scope, active marker, gate, size, run, created."""
    if not rows:
        return "no adapter versions (propose one: selfdistill adapters propose RUN_DIR)"
    lines = [f"{'VERSION':<13} {'SCOPE':<22} {'ACTIVE':<6} {'GATE':<4} {'BYTES':>10}  RUN"]
    for r in rows:
        active = "*" if r["scope"] in r["active_in"] else ""
        gone = " (weights removed)" if r["weights_deleted_at"] else ""
        lines.append(
            f"{r['short']:<13} {r['scope']:<22} {active:<6} "
            f"{verdict_word(r['last_gate']):<4} {r['size_bytes']:>10}  "
            f"{r['run_name'] or '-'} {r['created_at'][:19]}{gone}"
        )
    return "\n".join(lines)


def _data(ids: list[str]) -> str:
    if not ids:
        return "no recorded data ids"
    more = f", … ({len(ids)} in all)" if len(ids) > DATA_IDS_SHOWN else ""
    return ", ".join(ids[:DATA_IDS_SHOWN]) + more


def lineage_text(chain: list[dict[str, Any]]) -> str:
    """The chain newest first, one block per version."""
    out = []
    for depth, v in enumerate(chain):
        pad = "  " * depth
        runs = v["gate_runs"]
        gate = (
            f"{len(runs)} gate run(s), last {runs[-1]['verdict']['summary']}"
            if runs
            else "never gated by the registry"
        )
        train = (v["train_gate"] or {}).get("summary", "-")
        out += [
            f"{pad}{'└─ ' if depth else ''}{v['short']}  {v['scope']}  run {v['run_name']} "
            f"({v['run_id'] or 'no trace store'})",
            f"{pad}   data: {_data(v['data_ids'])}",
            f"{pad}   training gate: {train}; {gate}",
        ]
    return "\n".join(out)


def _label(text: str) -> str:
    return text.replace('"', "'")


def lineage_mermaid(chain: list[dict[str, Any]]) -> str:
    """A mermaid flowchart: parent → child versions, and each version's training run (with its
    number of data ids) feeding it."""
    lines = ["flowchart TD"]
    for v in chain:
        runs = v["gate_runs"]
        gate = runs[-1]["verdict"]["summary"] if runs else "not gated"
        lines.append(
            f'  v{v["short"]}["{v["short"]}<br/>{_label(v["scope"])}<br/>gate: {_label(gate)}"]'
        )
        run = f"r{v['run_id'] or v['short']}"
        lines.append(
            f'  {run}[/"run {_label(v["run_name"] or "?")}<br/>{len(v["data_ids"])} data ids"/]'
        )
        lines.append(f"  {run} -. trained .-> v{v['short']}")
        if v["parent_id"]:
            lines.append(f"  v{v['parent_id'][:12]} --> v{v['short']}")
    return "\n".join(lines)


def diff_text(d: dict[str, Any]) -> str:
    """Two columns, A and B, one row per field, training suite and gate check."""
    rows = [("", d["a"][:12], d["b"][:12])]
    for k, v in d["fields"].items():
        cut = 12 if k in ("parent_id", "base_sha256") else None  # ids: a prefix is enough here
        rows.append((k, str(v["a"])[:cut], str(v["b"])[:cut]))
    rows += [
        (f"after training: {k}", str(v["a"]), str(v["b"])) for k, v in d["train_after"].items()
    ]
    rows.append(("data ids", str(d["data_ids"]["a"]), str(d["data_ids"]["b"])))
    rows.append(("gate", str(d["gate"]["a"]), str(d["gate"]["b"])))

    def check(c: dict[str, Any] | None) -> str:
        if c is None:
            return "-"
        return f"{'pass' if c['passed'] else 'FAIL'} {c['before']:g}→{c['after']:g}"

    rows += [(f"  {n}", check(c["a"]), check(c["b"])) for n, c in d["gate"]["checks"].items()]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}" for r in rows)
