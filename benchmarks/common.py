"""Helpers shared by the benchmark scripts: process memory, machine description, worker
subprocesses, statistics and the Markdown/PNG outputs. Benchmarks only; the package never
imports this.

Memory is read from the operating system, never estimated: ``peak_rss_bytes`` is
``getrusage(RUSAGE_SELF).ru_maxrss`` (the largest resident set the process ever had),
``current_rss_bytes`` the resident set now (/proc/self/statm). Running each measured
configuration in its own subprocess makes the peak belong to that configuration alone.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1024 * 1024

# Settings every benchmark worker runs under (the OpenMP wait policy is an option: `omp_env`).
WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc/self/statm; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (a very large number where it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, e.g. "3.10 2.95 2.80"."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line naming the machine: CPU model, visible cores, memory."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError):
        mem = float("nan")
    return f"{cpu_name()}, {os.cpu_count()} visible cores, {mem:.0f} GiB RAM"


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def spawn(script: str | Path, cfg: dict[str, Any], *, env: dict[str, str] | None = None,
          timeout: float | None = None) -> dict[str, Any]:
    """Run ``python SCRIPT --worker JSON(cfg)`` in a fresh process; return the JSON object its
    last stdout line holds, or ``{"error": ...}`` with the tail of its stderr."""
    full_env = {**os.environ, **WORKER_ENV, **(env or {})}
    try:
        proc = subprocess.run([sys.executable, str(script), "--worker", json.dumps(cfg)],
                              capture_output=True, text=True, check=False, env=full_env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"rc={proc.returncode} {proc.stderr.strip()[-600:]}"}
    return json.loads(lines[-1])


def worker_main(argv: list[str], run: Any) -> bool:
    """When ``argv`` is ``[--worker, JSON]``, run ``run(cfg)`` and print its JSON result (the
    line `spawn` reads); returns whether this process was a worker."""
    if len(argv) == 2 and argv[0] == "--worker":
        print(json.dumps(run(json.loads(argv[1]))), flush=True)
        return True
    return False


def summary(xs: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of a sample (NaN for an empty one)."""
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def ratio(num: float | None, den: float | None) -> str:
    """num/den to two decimals, "n/a" when either is missing or zero."""
    if not num or not den or num != num or den != den:
        return "n/a"
    return f"{num / den:.2f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats are written with 4 significant digits."""
    def cell(x: Any) -> str:
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_dir: Path, name: str, markdown: str, data: dict[str, Any] | None = None
                 ) -> Path:
    """Write ``NAME.md`` (and ``NAME.json`` with the raw numbers) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text(markdown)
    if data is not None:
        (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    return path


def publish(out_dir: Path, name: str, text: str, data: dict[str, Any],
            plot: Any) -> None:
    """Print the report, write NAME.md / NAME.json and the plot NAME.png (``plot(path)``)."""
    print(text)
    write_report(out_dir, name, text, data)
    plot(out_dir / f"{name}.png")


def pyplot() -> Any:
    """matplotlib.pyplot with the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def header(title: str, settings: str, load_start: str, load_end: str) -> str:
    """The common opening of every report: title, date, machine, load averages, settings."""
    return (f"# {title}\n\n{now()} on {machine()}. Load average (1/5/15 min) at start "
            f"{load_start}, at end {load_end}: the machine's cores are shared with other jobs, "
            f"so times carry their noise.\n\n{settings}\n")


def tiny_model_dir(target: Path, *, hidden: int = 32, layers: int = 2) -> str:
    """Save a tiny random Llama with the default model's tokenizer into ``target`` (for the CI
    smoke runs: real code paths, seconds instead of minutes) and return its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfdistill.models import default_model_dir, load_tokenizer

    if (target / "config.json").is_file():
        return str(target)
    tok = load_tokenizer(str(default_model_dir(progress=False)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper next-token distributions than the near-uniform random init
        model.get_input_embeddings().weight.mul_(50.0)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return str(target)


def default_model_path() -> str:
    """The converted embedded default model's directory (converted on first use)."""
    from selfdistill.models import default_model_dir

    return str(default_model_dir(progress=False))


def train_job(config: Path, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """One `selfdistill train CONFIG key=value ...` job in this process, without a trace store;
    returns its summary (accuracies before / after / oracle, timings)."""
    from selfdistill.train.config import load_config
    from selfdistill.train.run import run_training

    cfg = load_config(config, [*overrides, f"output_dir={out_dir}", "trace_store=null"])
    return run_training(cfg, progress=False)


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write as PNG and close a matplotlib figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)


def add_omp_option(ap: Any, default: str) -> None:
    """`--omp-wait-policy` for benchmarks that spawn workers (pass `omp_env(...)` to them).
    PASSIVE makes idle OpenMP threads sleep at once: polite when other busy processes share the
    cores, but each parallel kernel then pays a wake-up, which dominates workloads of many
    small kernels (CPU decoding: 5.0 s → 7.2 s for 8 x 64 tokens of the default model, idle
    AVX512 EPYC, 2026-11-24). "default" leaves the environment as it is (libgomp spins a while
    before sleeping), which is how a user's process runs."""
    ap.add_argument("--omp-wait-policy", choices=("passive", "active", "default"),
                    default=default, help=f"OMP_WAIT_POLICY of the workers (default: {default}; "
                    "'default' leaves the environment as it is)")


def omp_env(policy: str) -> dict[str, str]:
    """The environment entries a worker needs for `--omp-wait-policy policy`."""
    return {} if policy == "default" else {"OMP_WAIT_POLICY": policy.upper()}


def base_parser(doc: str) -> Any:
    """The options every benchmark has: --quick (CI smoke setting), --threads, --out-dir."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: tiny setting")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where reports go")
    return ap
