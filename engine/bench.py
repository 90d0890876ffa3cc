"""Headless benchmark: the decoding modes of one ChatSession side by side with
the transformers baselines, interleaved, with medians and within-run ratios.

    session = ChatSession.load(target_spec, draft_spec)
    prompts = load_prompts("prompts.jsonl")
    result = run_bench(session, prompts, arms=["plain", "spec"], max_new_tokens=64)
    result.write_json("bench/result.json")

Method:

- Arms are the session's modes (`plain`, `spec`, `self-spec`, `early-exit`)
  and, as the peer column, transformers' own `model.generate` on the very
  model objects the session holds: `hf-generate` (plain greedy) and
  `hf-assisted` (`assistant_model=` the session's draft, HF defaults for the
  number of assistant tokens). Same prompt ids, same `max_new_tokens`, same
  end-of-sequence ids; only new tokens are counted.
- After a warm-up (one short run of every arm, which also finds the modes
  this build cannot run), the timed runs go in blocks: one block per
  (repeat, prompt), every arm once in each block. The arm order rotates from
  block to block (A B C, B C A, C A B, ...), so drift in the machine's speed
  and "first after a prompt change" effects hit every arm alike.
- Every run starts from a fresh conversation with empty KV caches: the whole
  prompt (prior turns included) is prefilled each time, for every arm. No
  prefix is reused across runs.
- Speed ratios are paired: arm / reference within the same block, then the
  median over blocks. Medians, minima and maxima are reported, with the
  machine's load at the start and the end of the run.

Per-token latency: the gap between one emission and the previous one,
divided by the tokens it carried; the first emission (which includes the
prefill) is time to first token and is left out of the per-token figures.
This is defined the same way for the session's rounds and for the chunks
transformers hands its streamer.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .bench_runs import (
    BASELINES,
    HF_ASSISTED,
    HF_GENERATE,
    SESSION_ARMS,
    BenchPrompt,
    Memory,
    PromptFileError,
    RunRecord,
    fresh_conversation,
    hf_assistant_settings,
    hf_generation_config,
    load_prompts,
    run_hf_arm,
    run_session_arm,
)
from .bench_stats import (
    acceptance_by_position,
    interleaved_order,
    median,
    paired_ratios,
    ratio,
    spread,
)
from .config import DecodeConfig, Mode
from .events import to_dict
from .metrics import percentile

if TYPE_CHECKING:
    from .session import ChatSession
    from .telemetry import Telemetry

try:
    import psutil
except Exception:  # pragma: no cover - psutil is a dependency
    psutil = None  # type: ignore[assignment]

__all__ = [
    "BASELINES",
    "HF_ASSISTED",
    "HF_GENERATE",
    "SESSION_ARMS",
    "BenchProgress",
    "BenchPrompt",
    "BenchResult",
    "PromptFileError",
    "RunRecord",
    "load_prompts",
    "run_bench",
    "summarize",
]


# -- the whole run -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchProgress:
    done: int
    total: int
    phase: str  # "warm-up" | "run"
    arm: str
    prompt_id: str


def machine_load(interval: float = 0.5) -> dict[str, Any]:
    """Load averages, CPU use over `interval` seconds, and this process's peak RSS so far
    (None where unavailable)."""
    out: dict[str, Any] = {
        "loadavg": None,
        "cpu_percent": None,
        "cpu_percent_per_core": None,
        "process_peak_rss_bytes": None,
    }
    with contextlib.suppress(OSError):
        out["loadavg"] = list(os.getloadavg())
    with contextlib.suppress(ImportError, OSError):
        import resource

        # ru_maxrss is in KiB on Linux (bytes on macOS).
        scale = 1 if platform.system() == "Darwin" else 1024
        out["process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    if psutil is not None:
        per_core = psutil.cpu_percent(interval=interval, percpu=True)
        out["cpu_percent_per_core"] = per_core
        out["cpu_percent"] = sum(per_core) / len(per_core) if per_core else None
    return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(session: ChatSession) -> dict[str, Any]:
    dev = session.target.device
    env: dict[str, Any] = {
        "specchat": _version("specchat"),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "device": str(dev),
        "cuda": None,
    }
    if dev.type == "cuda":
        env["cuda"] = {"name": torch.cuda.get_device_name(dev), "version": torch.version.cuda}
    return env


def model_record(session: ChatSession) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role, loaded in (("target", session.target), ("draft", session.draft)):
        if loaded is None:
            out[role] = None
            continue
        info = to_dict(loaded.info)
        info.pop("type", None)
        info["weights_sha256"] = loaded.weights_sha256
        out[role] = info
    out["cost_ratio_c"] = session.costs.ratio()
    return out


@dataclass(slots=True)
class BenchResult:
    config: dict[str, Any]
    environment: dict[str, Any]
    models: dict[str, Any]
    arms: list[str]
    load_start: dict[str, Any]
    load_end: dict[str, Any]
    records: list[RunRecord]
    warmup: list[RunRecord]
    unavailable: dict[str, str]
    seconds: float
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_kind: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "environment": self.environment,
            "models": self.models,
            "arms": self.arms,
            "noise": {"load_start": self.load_start, "load_end": self.load_end},
            "unavailable": self.unavailable,
            "seconds": self.seconds,
            "summary": self.summary,
            "by_kind": self.by_kind,
            "runs": [r.to_dict() for r in self.records],
            "warmup": [r.to_dict() for r in self.warmup],
        }

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n", encoding="utf-8")
        return path


def run_bench(
    session: ChatSession,
    prompts: Sequence[BenchPrompt],
    *,
    arms: Sequence[str] = ("plain", "spec"),
    baselines: bool = True,
    config: DecodeConfig | None = None,
    max_new_tokens: int | None = None,
    repeats: int = 1,
    seed: int = 0,
    warmup: bool = True,
    rotate: bool = True,
    progress: Callable[[BenchProgress], None] | None = None,
    telemetry: Telemetry | None = None,
) -> BenchResult:
    """Benchmark `arms` (session modes) and, with `baselines`, transformers' generate.

    `config` gives the decoding settings (its mode is replaced per arm);
    `max_new_tokens` overrides its length. Seeds: run (repeat r, prompt i)
    uses seed + 1000 r + i in every arm, so sampled runs are paired too.
    """
    arms = list(dict.fromkeys(arms))
    for a in arms:
        if a not in SESSION_ARMS and a not in BASELINES:
            raise ValueError(f"unknown arm {a!r}; choose from {SESSION_ARMS + BASELINES}")
    if baselines:
        arms += [b for b in BASELINES if b not in arms]
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not prompts:
        raise ValueError("no prompts")
    cfg = config or DecodeConfig()
    if max_new_tokens is not None:
        cfg = cfg.with_(max_new_tokens=max_new_tokens)
    cfg = cfg.with_(stop=())
    original_system = session.system_prompt
    memory = Memory(session.target.device)
    t_begin = time.perf_counter()
    load_start = machine_load()

    def one(arm: str, p: BenchPrompt, run_cfg: DecodeConfig, rec: RunRecord, s: int) -> RunRecord:
        fresh_conversation(session, p, original_system)
        run_cfg = run_cfg.with_(seed=s)
        if arm in BASELINES:
            return run_hf_arm(session, p, arm, run_cfg, rec, memory, s, telemetry)
        return run_session_arm(session, p, arm, run_cfg, rec, memory, telemetry)

    order = interleaved_order(arms, len(prompts), repeats, rotate=rotate)
    total = len(order) + (len(arms) if warmup else 0)
    done = 0
    warm: list[RunRecord] = []
    unavailable: dict[str, str] = {}
    try:
        if warmup:
            p0 = prompts[0]
            warm_cfg = cfg.with_(max_new_tokens=min(8, cfg.max_new_tokens))
            for arm in arms:
                if progress:
                    progress(BenchProgress(done, total, "warm-up", arm, p0.id))
                rec = one(arm, p0, warm_cfg, RunRecord(arm, p0.id, p0.kind, -1, -1, 0), seed)
                warm.append(rec)
                if rec.status == "unavailable":
                    unavailable[arm] = rec.error or "not available"
                done += 1
        records: list[RunRecord] = []
        slots: Counter[int] = Counter()
        for r, i, arm in order:
            p = prompts[i]
            block = r * len(prompts) + i
            slot = slots[block]
            slots[block] += 1
            if progress:
                progress(BenchProgress(done, total, "run", arm, p.id))
            rec = RunRecord(arm, p.id, p.kind, r, block, slot)
            if arm in unavailable:
                rec.status, rec.error = "unavailable", unavailable[arm]
            else:
                one(arm, p, cfg, rec, seed + 1000 * r + i)
                if rec.status == "unavailable":
                    unavailable.setdefault(arm, rec.error or "not available")
            records.append(rec)
            done += 1
        if progress:
            progress(BenchProgress(done, total, "done", "", ""))
    finally:
        session.system_prompt = original_system
        session.reset()
    seconds = time.perf_counter() - t_begin
    result = BenchResult(
        config={
            "arms": arms,
            "prompts": [asdict(p) for p in prompts],
            "repeats": repeats,
            "seed": seed,
            "warmup": warmup,
            "rotate": rotate,
            "decode": {
                k: (v.value if isinstance(v, Mode) else v)
                for k, v in asdict(cfg).items()
                if k != "mode"
            },
            "hf_assistant": hf_assistant_settings(session) if HF_ASSISTED in arms else None,
            "hf_generation": hf_generation_config(session, cfg, cfg.max_new_tokens).to_diff_dict()
            if any(a in BASELINES for a in arms)
            else None,
            "cache_policy": "every run starts a fresh conversation with empty KV caches "
            "(whole prompt prefilled, no prefix reuse), for every arm",
            "latency_definition": "gap between an emission and the previous one / tokens it "
            "carried; the first emission is time to first token",
        },
        environment=environment(session),
        models=model_record(session),
        arms=arms,
        load_start=load_start,
        load_end=machine_load(),
        records=records,
        warmup=warm,
        unavailable=unavailable,
        seconds=seconds,
    )
    summarize(result)
    return result


# -- aggregation ---------------------------------------------------------------------


def figures(records: Sequence[RunRecord]) -> dict[str, Any]:
    """Medians and pooled rates over the ok runs of one arm (and one kind)."""
    ok = [r for r in records if r.ok]
    tps = [v for v in (r.tokens_per_s for r in ok) if v is not None]
    latencies = [v for r in ok for v in r.latencies_ms]
    rounds = [kr for r in ok for kr in r.rounds]
    drafted = sum(k for k, _ in rounds)
    accepted = sum(a for _, a in rounds)
    tokens = sum(r.n_tokens for r in ok)
    exit_layers = Counter(layer for r in ok for layer in r.exit_layers)
    layers = [(r.mean_layers, r.n_tokens) for r in ok if r.mean_layers is not None]
    chunks = [c for r in ok for c in r.chunks]
    rss = [r.rss_bytes for r in ok if r.rss_bytes is not None]
    cuda = [r.cuda_peak_bytes for r in ok if r.cuda_peak_bytes is not None]
    tps_spread = spread(tps)
    return {
        "runs": len(ok),
        "tokens": tokens,
        "tokens_per_s": tps_spread,
        "noise": ratio(
            (tps_spread["max"] or 0.0) - (tps_spread["min"] or 0.0), tps_spread["median"]
        ),
        "decode_tokens_per_s": median(v for v in (r.decode_tokens_per_s for r in ok) if v),
        "ttft_s": median(r.ttft_s for r in ok if r.ttft_s is not None),
        "latency_ms": {
            "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95),
            "min": min(latencies) if latencies else None,
            "max": max(latencies) if latencies else None,
        },
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": (accepted + len(rounds)) / len(rounds) if rounds else None,
        "acceptance_by_position": acceptance_by_position(rounds),
        "tokens_per_target_pass": sum(chunks) / len(chunks) if chunks else None,
        "exit_rate": sum(r.early_exits for r in ok) / tokens
        if tokens and (layers or exit_layers)
        else None,
        "mean_layers": sum(m * n for m, n in layers) / sum(n for _, n in layers)
        if layers and sum(n for _, n in layers)
        else None,
        "exit_layer_histogram": {str(k): v for k, v in sorted(exit_layers.items())},
        "fallbacks": sum(len(r.fallbacks) for r in ok),
        "peak_rss_bytes": max(rss) if rss else None,
        "cuda_peak_bytes": max(cuda) if cuda else None,
    }


def summarize(result: BenchResult) -> None:
    """Fill result.summary (per arm) and result.by_kind (per prompt kind, per arm)."""
    refs = [a for a in ("plain", HF_GENERATE) if a in result.arms]
    kinds = sorted({r.kind for r in result.records})

    def table(records: list[RunRecord]) -> dict[str, dict[str, Any]]:
        by_arm = {a: [r for r in records if r.arm == a] for a in result.arms}
        tps = {
            a: {r.block: r.tokens_per_s for r in rs if r.tokens_per_s is not None}
            for a, rs in by_arm.items()
        }
        tokens = {a: {r.block: r.tokens for r in rs if r.ok} for a, rs in by_arm.items()}
        out: dict[str, dict[str, Any]] = {}
        for a, rs in by_arm.items():
            f = figures(rs)
            f["status"] = (
                "unavailable" if a in result.unavailable else ("ok" if f["runs"] else "failed")
            )
            f["reason"] = result.unavailable.get(a) or next((r.error for r in rs if r.error), None)
            for ref in refs:
                ratios = paired_ratios(tps[a], tps[ref])
                f[f"speedup_vs_{ref}"] = spread(ratios)
            if "plain" in by_arm and a != "plain":
                same = [
                    tokens[a][b] == tokens["plain"][b] for b in tokens[a] if b in tokens["plain"]
                ]
                f["same_tokens_as_plain"] = {"equal": sum(same), "compared": len(same)}
            out[a] = f
        return out

    result.summary = table(result.records)
    result.by_kind = {k: table([r for r in result.records if r.kind == k]) for k in kinds}
