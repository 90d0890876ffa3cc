"""Headless benchmark: the decoding modes of one or more ChatSessions side by side
with the transformers baselines, interleaved, with medians and within-run ratios.

    session = ChatSession.load(target_spec, draft_spec)
    prompts = load_prompts("prompts.jsonl")
    result = run_bench(session, prompts, arms=["plain", "spec"], max_new_tokens=64)
    result.write_json("bench/result.json")

Several model configurations (quantization, dtype) in one run: one loaded
session each, passed as `BenchConfig`s; `load_configs` loads them one after
the other and names the one that fails.

Method:

- Arms are the session's modes (`plain`, `spec`, `self-spec`, `early-exit`)
  on every config and, as the peer column, transformers' own
  `model.generate` on the very model objects one config's session holds:
  `hf-generate` (plain greedy) and `hf-assisted` (`assistant_model=` the
  session's draft, HF defaults for the number of assistant tokens). Same
  prompt ids, same `max_new_tokens`, same end-of-sequence ids; only new
  tokens are counted. With several configs an arm is labelled `mode@config`.
- After a warm-up (one short run of every arm, which also finds the modes
  this build cannot run), the timed runs go in blocks: one block per
  (repeat, prompt), every arm once in each block. The arm order rotates from
  block to block (A B C, B C A, C A B, ...), so drift in the machine's speed
  and "first after a prompt change" effects hit every arm alike.
- Every run starts from a fresh conversation with empty KV caches: the whole
  prompt (prior turns included) is prefilled each time, for every arm. No
  prefix is reused across runs.
- Speed ratios are paired: arm / reference within the same block, then the
  median over blocks. The reference is `hf-generate` when it runs, else the
  first arm, unless the caller names one; `×plain` is against the plain arm
  of the same config. Medians, minima and maxima are reported, with the
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

from ..config import W4A8_MODES, DecodeConfig, Mode
from ..errors import EngineError, OutOfMemoryError
from ..events import to_dict
from ..metrics import acceptance_by_position, percentile
from ..model import cpu, native
from .bench_runs import (
    BASELINES,
    HF_ASSISTED,
    HF_GENERATE,
    SERVER_ARM,
    SESSION_ARMS,
    Arm,
    BenchPrompt,
    ConfigSpec,
    ConfigSpecError,
    Memory,
    PromptFileError,
    RunRecord,
    fresh_conversation,
    hf_assistant_settings,
    hf_generation_config,
    load_prompts,
    make_arms,
    parse_config_spec,
    parse_config_specs,
    run_hf_arm,
    run_server_arm,
    run_session_arm,
)
from .bench_stats import (
    interleaved_order,
    median,
    paired_ratios,
    ratio,
    spread,
)

if TYPE_CHECKING:
    from ..decode.session import ChatSession
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
    "Arm",
    "BenchConfig",
    "BenchProgress",
    "BenchPrompt",
    "BenchResult",
    "ConfigLoadError",
    "ConfigSpec",
    "ConfigSpecError",
    "PromptFileError",
    "RunRecord",
    "load_configs",
    "load_prompts",
    "parse_config_spec",
    "parse_config_specs",
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


def cpu_name() -> str | None:
    """The CPU's model name as Linux lists it ("AMD EPYC", "Intel(R) Xeon(R) ..."), None elsewhere."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or None


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
        "cpu": cpu_name(),
        "cpu_features": cpu.features().summary(),
        "w4a8_path": native.w4a8_path(),  # None where no w4a8 kernel is loaded
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
    runner = session.target_runner
    out["native_decoder"] = "on" if runner.native is not None else f"off: {runner.native_off}"
    return out


# -- model configurations ------------------------------------------------------------


class ConfigLoadError(EngineError):
    """One configuration of a multi-config benchmark could not be loaded."""


@dataclass(slots=True)
class BenchConfig:
    """One loaded model configuration under test: its label and its session."""

    label: str
    session: ChatSession
    spec: ConfigSpec | None = None
    load: dict[str, Any] = field(default_factory=dict)  # seconds, RSS before and after loading
    # The w4a8 kernel's fewest rows for its VNNI code and why, as this config's load chose
    # them (None: no w4a8 kernel loaded); put back before each of its runs.
    vnni_rows: tuple[int, str] | None = None


def session_label(session: ChatSession) -> str:
    """A config label read from what was loaded: `int8/int4:float32`."""
    t, d = session.target.info, session.draft.info if session.draft else None
    return f"{t.quant}/{d.quant}:{t.dtype}" if d else f"{t.quant}:{t.dtype}"


def _rss_bytes() -> int | None:
    if psutil is None:
        return None
    return int(psutil.Process(os.getpid()).memory_info().rss)


def use_w4a8_path(spec: ConfigSpec | None, vnni_rows: tuple[int, str] | None = None) -> None:
    """The w4a8 kernel's path for a config's runs: its ~PATH, else $SPECCHAT_W4A8's or this
    CPU's choice, with the rows its load chose for the VNNI code (`vnni_rows`, where it
    chose). Only where a path is named or the kernel is loaded (a run without w4a8 builds
    nothing)."""
    want = spec.w4a8_path if spec is not None else None
    if want or native.w4a8_path() is not None:
        native.w4a8_use(want or native.w4a8_default())
        if vnni_rows is not None:
            native.w4a8_set_vnni_min_rows(*vnni_rows)


def load_configs(
    specs: Sequence[ConfigSpec], load: Callable[[ConfigSpec], ChatSession]
) -> list[BenchConfig]:
    """Load every config with `load`, one after the other; all stay loaded for the run.

    RSS before and after each load is recorded (`BenchConfig.load`). A config
    that fails to load raises `ConfigLoadError` naming it, with the reason (and,
    when memory ran short, which configs were held meanwhile); no later config
    is tried.
    """
    out: list[BenchConfig] = []
    for spec in specs:
        before = _rss_bytes()
        t0 = time.perf_counter()
        try:
            use_w4a8_path(spec)  # the costs measured at load are that path's
            session = load(spec)
        except (EngineError, MemoryError, RuntimeError, OSError, ValueError) as exc:
            if isinstance(exc, EngineError):
                reason, hint = exc.message, exc.hint
            else:
                text = str(exc).strip()
                reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(
                    ": "
                )
                hint = ""
            short_of_memory = isinstance(exc, MemoryError | OutOfMemoryError) or (
                "memory" in str(exc).lower()
            )
            if out and short_of_memory:
                held = ", ".join(c.label for c in out)
                hint = (hint + "; " if hint else "") + (
                    f"{held} stayed loaded while it loaded (every config of a run is held "
                    "at once): benchmark fewer or smaller configs per run"
                )
            raise ConfigLoadError(f"config {spec.label!r} did not load: {reason}", hint) from exc
        after = _rss_bytes()
        out.append(
            BenchConfig(
                spec.label,
                session,
                spec,
                {
                    "seconds": time.perf_counter() - t0,
                    "rss_before_bytes": before,
                    "rss_after_bytes": after,
                },
                native.w4a8_vnni_rows() if session.target.info.quant in W4A8_MODES else None,
            )
        )
    return out


def config_record(bc: BenchConfig) -> dict[str, Any]:
    """What a config is and what its models hold in memory (runs' RSS added by summarize)."""
    t, d = bc.session.target.info, bc.session.draft.info if bc.session.draft else None
    before, after = bc.load.get("rss_before_bytes"), bc.load.get("rss_after_bytes")
    return {
        "label": bc.label,
        "spec": asdict(bc.spec) if bc.spec is not None else None,
        "models": model_record(bc.session),
        "memory": {
            "target_weight_bytes": t.weight_bytes,
            "target_kv_bytes_per_token": t.kv_bytes_per_token,
            "draft_weight_bytes": d.weight_bytes if d else None,
            "draft_kv_bytes_per_token": d.kv_bytes_per_token if d else None,
            "load_rss_delta_bytes": after - before
            if after is not None and before is not None
            else None,
            "peak_rss_bytes": None,
        },
        "load": bc.load,
        "w4a8_vnni_rows": (
            {"from": bc.vnni_rows[0], "why": bc.vnni_rows[1]} if bc.vnni_rows is not None else None
        ),
    }


@dataclass(slots=True)
class BenchResult:
    config: dict[str, Any]
    environment: dict[str, Any]
    models: dict[str, Any]  # the first config's models (the only ones in a one-config run)
    arms: list[str]
    load_start: dict[str, Any]
    load_end: dict[str, Any]
    records: list[RunRecord]
    warmup: list[RunRecord]
    unavailable: dict[str, str]
    seconds: float
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_kind: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    configs: list[dict[str, Any]] = field(default_factory=list)  # config_record per config
    reference: str | None = None  # the arm speed ratios are taken against

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "environment": self.environment,
            "models": self.models,
            "configs": self.configs,
            "arms": self.arms,
            "reference": self.reference,
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


def default_reference(arms: Sequence[Arm]) -> str:
    """`hf-generate` when it runs, else the first arm."""
    return next((a.label for a in arms if a.mode == HF_GENERATE), arms[0].label)


def run_bench(
    session: ChatSession | Sequence[BenchConfig],
    prompts: Sequence[BenchPrompt],
    *,
    arms: Sequence[str] = ("plain", "spec"),
    baselines: bool = True,
    baseline_config: str | None = None,
    reference: str | None = None,
    config: DecodeConfig | None = None,
    max_new_tokens: int | None = None,
    repeats: int = 1,
    seed: int = 0,
    warmup: bool = True,
    rotate: bool = True,
    progress: Callable[[BenchProgress], None] | None = None,
    telemetry: Telemetry | None = None,
    remote: Any | Sequence[Any] | None = None,
) -> BenchResult:
    """Benchmark `arms` (session modes) and, with `baselines`, transformers' generate.

    `session` is one ChatSession or several `BenchConfig`s: every mode runs on
    every config, the baselines on the config labelled `baseline_config` (default:
    the first). With several configs the arms are labelled `mode@config`.
    `reference` (an arm label) is what `speedup_vs_reference` divides by;
    default `hf-generate`, else the first arm.
    `config` gives the decoding settings (its mode is replaced per arm);
    `max_new_tokens` overrides its length. Seeds: run (repeat r, prompt i)
    uses seed + 1000 r + i in every arm, so sampled runs are paired too.
    `remote` (a `RemoteSession`, or several) adds a `server` arm each (`server1`,
    `server2`, ... for several): the same prompts through a served engine,
    interleaved with the local arms; two servers of one model, one with its draft
    and one without, give the server's own plain-vs-speculative ratio.
    """
    configs = (
        list(session)
        if isinstance(session, Sequence)
        else [BenchConfig(session_label(session), session)]
    )
    if not configs:
        raise ValueError("no configs")
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels) or any("@" in c or not c for c in labels):
        raise ValueError(f"config labels must be distinct, non-empty and free of '@': {labels}")
    by_config = dict(zip(labels, configs, strict=True))
    modes = list(dict.fromkeys(arms))
    for a in modes:
        if a not in SESSION_ARMS and a not in BASELINES:
            raise ValueError(f"unknown arm {a!r}; choose from {SESSION_ARMS + BASELINES}")
    base = [a for a in modes if a in BASELINES]
    if baselines:
        base += [b for b in BASELINES if b not in base]
    if baseline_config is None:
        baseline_config = labels[0]
    elif baseline_config not in by_config:
        raise ValueError(f"baseline config {baseline_config!r} is not one of {labels}")
    plan = make_arms(labels, [a for a in modes if a in SESSION_ARMS], base, baseline_config)
    remotes = [] if remote is None else list(remote) if isinstance(remote, Sequence) else [remote]
    served: dict[str, Any] = {}
    for n, r in enumerate(remotes, 1):
        label = SERVER_ARM if len(remotes) == 1 else f"{SERVER_ARM}{n}"
        served[label] = r
        plan.append(Arm(SERVER_ARM, labels[0], label))
    if not plan:
        raise ValueError("no arms to run")
    arm_of = {a.label: a for a in plan}
    if reference is None:
        reference = default_reference(plan)
    elif reference not in arm_of:
        raise ValueError(f"reference {reference!r} is not an arm of this run: {list(arm_of)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not prompts:
        raise ValueError("no prompts")
    cfg = config or DecodeConfig()
    if max_new_tokens is not None:
        cfg = cfg.with_(max_new_tokens=max_new_tokens)
    cfg = cfg.with_(stop=())
    original_system = {c.label: c.session.system_prompt for c in configs}
    memory = {c.label: Memory(c.session.target.device) for c in configs}
    t_begin = time.perf_counter()
    load_start = machine_load()

    paths = any(c.spec is not None and c.spec.w4a8_path for c in configs)

    def one(arm: Arm, p: BenchPrompt, run_cfg: DecodeConfig, rec: RunRecord, s: int) -> RunRecord:
        ses = by_config[arm.config].session
        if paths:  # configs that name the w4a8 kernel's path: each run on its own
            use_w4a8_path(by_config[arm.config].spec, by_config[arm.config].vnni_rows)
        fresh_conversation(ses, p, original_system[arm.config])
        run_cfg = run_cfg.with_(seed=s)
        if arm.mode == SERVER_ARM:
            return run_server_arm(served[arm.label], p, run_cfg, rec, telemetry)
        if arm.baseline:
            return run_hf_arm(ses, p, arm.mode, run_cfg, rec, memory[arm.config], s, telemetry)
        return run_session_arm(ses, p, arm.mode, run_cfg, rec, memory[arm.config], telemetry)

    def new_record(arm: Arm, p: BenchPrompt, r: int, block: int, slot: int) -> RunRecord:
        return RunRecord(arm.label, p.id, p.kind, r, block, slot, config=arm.config)

    order = interleaved_order(list(arm_of), len(prompts), repeats, rotate=rotate)
    total = len(order) + (len(plan) if warmup else 0)
    done = 0
    warm: list[RunRecord] = []
    unavailable: dict[str, str] = {}
    try:
        if warmup:
            p0 = prompts[0]
            warm_cfg = cfg.with_(max_new_tokens=min(8, cfg.max_new_tokens))
            for arm in plan:
                if progress:
                    progress(BenchProgress(done, total, "warm-up", arm.label, p0.id))
                rec = one(arm, p0, warm_cfg, new_record(arm, p0, -1, -1, 0), seed)
                warm.append(rec)
                if rec.status == "unavailable":
                    unavailable[arm.label] = rec.error or "not available"
                done += 1
        records: list[RunRecord] = []
        slots: Counter[int] = Counter()
        for r, i, label in order:
            arm = arm_of[label]
            p = prompts[i]
            block = r * len(prompts) + i
            slot = slots[block]
            slots[block] += 1
            if progress:
                progress(BenchProgress(done, total, "run", label, p.id))
            rec = new_record(arm, p, r, block, slot)
            if label in unavailable:
                rec.status, rec.error = "unavailable", unavailable[label]
            else:
                one(arm, p, cfg, rec, seed + 1000 * r + i)
                if rec.status == "unavailable":
                    unavailable.setdefault(label, rec.error or "not available")
            records.append(rec)
            done += 1
        if progress:
            progress(BenchProgress(done, total, "done", "", ""))
    finally:
        for c in configs:
            c.session.system_prompt = original_system[c.label]
            c.session.reset()
    seconds = time.perf_counter() - t_begin
    first = configs[0].session
    hf_session = by_config[baseline_config].session
    result = BenchResult(
        config={
            "arms": list(arm_of),
            "modes": [a for a in modes if a in SESSION_ARMS],
            "configs": labels,
            "baseline_config": baseline_config if base else None,
            "reference": reference,
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
            "hf_assistant": hf_assistant_settings(hf_session) if HF_ASSISTED in base else None,
            "hf_generation": hf_generation_config(
                hf_session.target, cfg, cfg.max_new_tokens
            ).to_diff_dict()
            if base
            else None,
            "cache_policy": "every run starts a fresh conversation with empty KV caches "
            "(whole prompt prefilled, no prefix reuse), for every arm"
            + (" (the server arm: a fresh conversation; the server's own prefix cache may "
               "reuse an earlier run's prompt)" if served else ""),
            "server": {label: r.ready.summary for label, r in served.items()} or None,
            "latency_definition": "gap between an emission and the previous one / tokens it "
            "carried; the first emission is time to first token",
        },
        environment=environment(first),
        models=model_record(first),
        arms=list(arm_of),
        load_start=load_start,
        load_end=machine_load(),
        records=records,
        warmup=warm,
        unavailable=unavailable,
        seconds=seconds,
        configs=[config_record(c) for c in configs],
        reference=reference,
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
    costs = [c for r in ok for c in r.spec_costs]
    step = median(r.target_step_ms for r in ok if r.target_step_ms)
    per_draft = sum(d for d, _ in costs) / drafted if costs and drafted else None
    per_verify = sum(v for _, v in costs) / len(costs) if costs else None
    served = [r.server for r in ok if r.server and r.server.get("draft_tokens") is not None]
    if served and not rounds:  # a served engine's arm: its own counts
        drafted = sum(int(x["draft_tokens"] or 0) for x in served)
        accepted = sum(int(x["accepted"] or 0) for x in served)
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
        "mean_accepted_length": (accepted + len(rounds)) / len(rounds)
        if rounds
        else _served_length(served) if served and not rounds else None,
        "acceptance_by_position": acceptance_by_position(rounds),
        # a served engine's passes are not seen by the client (its chunks are tokens)
        "tokens_per_target_pass": sum(chunks) / len(chunks) if chunks and not served else None,
        # as paid in flight, in plain target steps: c per drafted token, v per verify pass
        "cost_ratio_c": ratio(per_draft, step),
        "verify_ratio_v": ratio(per_verify, step),
        # the draft's catch-up passes (copies, plain stretches), per speculative round
        "catch_up_o": ratio(sum(r.catch_up_ms for r in ok) / len(costs), step) if costs else None,
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


def _served_length(served: list[dict[str, Any]]) -> float | None:
    """Tokens per verify step of a server's replies, over those that say their drafts."""
    with_steps = [x for x in served if x.get("drafts")]
    if not with_steps:
        return None
    steps = sum(int(x["drafts"]) for x in with_steps)
    return (sum(int(x["accepted"] or 0) for x in with_steps) + steps) / steps


def split_label(label: str) -> tuple[str, str]:
    """(mode, config) of an arm label; config is "" in a one-config run (`plain`)."""
    mode, _, config = label.partition("@")
    return mode, config


def summarize(result: BenchResult) -> None:
    """Fill result.summary (per arm), result.by_kind (per prompt kind, per arm) and the
    RSS peak of each config's runs.

    Ratios, each the median over blocks of arm / other arm in the same block:
    `speedup_vs_reference` (result.reference), `speedup_vs_plain` (the plain
    arm of the same config) and `speedup_vs_hf-generate` (the hf-generate arm).
    """
    split = {a: split_label(a) for a in result.arms}
    if result.reference is None and result.arms:
        result.reference = next((a for a in result.arms if split[a][0] == HF_GENERATE), None)
        result.reference = result.reference or result.arms[0]
    plain_of = {c: a for a, (m, c) in split.items() if m == "plain"}
    hf_gen = next((a for a in result.arms if split[a][0] == HF_GENERATE), None)
    kinds = sorted({r.kind for r in result.records})
    served_arms = set(result.config.get("server") or ())

    def table(records: list[RunRecord]) -> dict[str, dict[str, Any]]:
        by_arm = {a: [r for r in records if r.arm == a] for a in result.arms}

        def per_block(speed: Callable[[RunRecord], float | None]) -> dict[str, dict[int, float]]:
            return {
                a: {r.block: v for r in rs if (v := speed(r)) is not None} for a, rs in by_arm.items()
            }

        tps = per_block(lambda r: r.tokens_per_s)
        # After the first token: the prefill is every arm's alike, so this is what the
        # decoding alone gains (on the code edits a fifth of a reply is its first token).
        decode_tps = per_block(lambda r: r.decode_tokens_per_s)
        tokens = {a: {r.block: r.tokens for r in rs if r.ok} for a, rs in by_arm.items()}
        texts = {a: {r.block: r.text for r in rs if r.ok} for a, rs in by_arm.items()}
        out: dict[str, dict[str, Any]] = {}
        for a, rs in by_arm.items():
            mode, config = split[a]
            f: dict[str, Any] = {"mode": mode, "config": config or None}
            f.update(figures(rs))
            f["status"] = (
                "unavailable" if a in result.unavailable else ("ok" if f["runs"] else "failed")
            )
            f["reason"] = result.unavailable.get(a) or next((r.error for r in rs if r.error), None)
            plain = plain_of.get(config)
            refs = {"plain": plain, HF_GENERATE: hf_gen, "reference": result.reference}
            for name, ref in refs.items():
                if ref is not None:
                    f[f"speedup_vs_{name}"] = spread(paired_ratios(tps[a], tps[ref]))
            if plain is not None:
                f["decode_speedup_vs_plain"] = spread(paired_ratios(decode_tps[a], decode_tps[plain]))
            if plain is not None and a != plain:
                # a served engine's ids are mostly unknown (its API sends text): its text
                by = texts if a in served_arms else tokens
                same = [by[a][b] == by[plain][b] for b in by[a] if b in by[plain]]
                f["same_tokens_as_plain"] = {"equal": sum(same), "compared": len(same)}
            out[a] = f
        return out

    result.summary = table(result.records)
    result.by_kind = {k: table([r for r in result.records if r.kind == k]) for k in kinds}
    for c in result.configs:
        rss = [
            r.rss_bytes
            for r in result.records
            if r.ok and r.rss_bytes is not None and r.config == c["label"]
        ]
        c["memory"]["peak_rss_bytes"] = max(rss) if rss else None
