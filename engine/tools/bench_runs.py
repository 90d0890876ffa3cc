"""One benchmark run: a prompt from a prompt file, decoded by one arm.

An arm is a session mode (`plain`, `spec`, `self-spec`, `early-exit`) or a
transformers baseline run on the session's own model objects:
`hf-generate` (`model.generate`) and `hf-assisted` (`model.generate(
assistant_model=draft)`), on one model configuration (a `ConfigSpec`:
target quantization, draft quantization, dtype). A `RunRecord` holds
everything measured.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import LOCAL_MODES, SPEC_VARIANTS, W4A8_MODES, DecodeConfig, Mode, QuantMode
from ..errors import EngineError
from ..events import Failed, Notice, RoundEvent, TokenEvent, TurnFinished, TurnStarted
from ..model import native

if TYPE_CHECKING:
    from ..decode.session import ChatSession
    from ..weights.loading import LoadedModel
    from .telemetry import Telemetry

try:
    import psutil
except Exception:  # pragma: no cover - psutil is a dependency
    psutil = None  # type: ignore[assignment]

HF_GENERATE = "hf-generate"
HF_ASSISTED = "hf-assisted"
BASELINES = (HF_GENERATE, HF_ASSISTED)
SESSION_ARMS = (*(m.value for m in LOCAL_MODES), *SPEC_VARIANTS)
# A served engine's arm (`bench --server URL`): the same prompts through the server, which
# decodes as it was started to; it runs beside the local arms in the same interleaving.
SERVER_ARM = "server"
ROLES = ("system", "user", "assistant")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTS = ("auto", *(q.value for q in QuantMode))


class PromptFileError(EngineError):
    """The prompt file cannot be read or a line is not a prompt."""


class ConfigSpecError(EngineError):
    """A --configs entry is not CONFIG_SYNTAX, or names no config of the run."""


# -- model configurations and arms ---------------------------------------------------

CONFIG_SYNTAX = "TARGETQUANT[/DRAFTQUANT[+vN]][:DTYPE][~W4A8PATH]"
W4A8_PATHS = tuple(native.W4A8_PATHS)  # what ~PATH may name


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """One model configuration of a benchmark: how target and draft are held.

    `label` is the text as given (lower case, no spaces); it names the config in
    arm labels (`spec@int8/int4`). Two specs are the same configuration when
    their quantizations, draft vocabulary and dtype are equal, whatever their text.
    """

    label: str
    target_quant: str  # a QuantMode value or "auto"
    draft_quant: str  # defaults to the target's
    dtype: str  # one of DTYPES
    draft_vocab: int | None = None  # +vN: the draft's shortlist head; None: --draft-vocab
    w4a8_path: str | None = None  # ~avx2 / ~avx512vnni: the w4a8 kernel's path for its runs

    @property
    def key(self) -> tuple[str, str, str, int | None, str | None]:
        return (self.target_quant, self.draft_quant, self.dtype, self.draft_vocab, self.w4a8_path)


def _config_error(text: str, what: str) -> ConfigSpecError:
    return ConfigSpecError(
        f"bad config {text!r}: {what}",
        hint=f"a config is {CONFIG_SYNTAX}, e.g. int8/int4:float32, w4a8/w4a8+v65536 or w4a8~avx2; "
        f"quantizations: {', '.join(QUANTS)}; dtypes: {', '.join(DTYPES)}",
    )


def parse_config_spec(text: str, dtype: str = "auto") -> ConfigSpec:
    """`TARGETQUANT[/DRAFTQUANT[+vN]][:DTYPE][~W4A8PATH]`; the draft quantization defaults to
    the target's and the dtype to `dtype` (the --dtype flag); `+vN` gives the draft a
    shortlist head over N ids (as --draft-vocab N does for every config); `~avx2`,
    `~avx512vnni` or `~amx` runs the config's turns on that path of the w4a8 kernel (the
    same bits, another speed), so the paths are priced in one interleaved run."""
    label = text.strip().lower()
    if not label:
        raise _config_error(text, "it is empty")
    rest, tilde, path = label.partition("~")
    if tilde and path not in W4A8_PATHS:
        raise _config_error(text, f"~{path} is no w4a8 path ({', '.join(W4A8_PATHS)})")
    quants, sep, dt = rest.partition(":")
    if sep:
        if dt not in DTYPES:
            raise _config_error(text, f"unknown dtype {dt!r}")
    else:
        dt = dtype
    quants, plus, vocab_text = quants.partition("+")
    vocab = None
    if plus:
        if "/" not in quants:
            raise _config_error(text, "+vN belongs to the draft: TARGETQUANT/DRAFTQUANT+vN")
        if not (vocab_text.startswith("v") and vocab_text[1:].isdigit()):
            raise _config_error(text, f"the draft vocabulary {vocab_text!r} is not vN")
        vocab = int(vocab_text[1:])
        if vocab < 1:
            raise _config_error(text, "the draft vocabulary must be at least 1")
    parts = quants.split("/")
    if len(parts) > 2:
        raise _config_error(text, "more than one '/' (target and draft only)")
    for part, role in zip(parts, ("target", "draft"), strict=False):
        if not part:
            raise _config_error(text, f"the {role} quantization is missing")
        if part not in QUANTS:
            raise _config_error(text, f"unknown {role} quantization {part!r}")
    target = parts[0]
    draft = parts[1] if len(parts) == 2 else target
    if tilde and not {"auto", *(m.value for m in W4A8_MODES)} & {target, draft}:
        raise _config_error(text, f"~{path} chooses the w4a8 kernel's path, and no model is w4a8")
    return ConfigSpec(label, target, draft, dt, vocab, path or None)


def parse_config_specs(text: str, dtype: str = "auto") -> list[ConfigSpec]:
    """A comma-separated list of configs; the same configuration twice is an error."""
    specs = [parse_config_spec(t, dtype) for t in text.split(",")]
    seen: dict[tuple[str, str, str, int | None, str | None], str] = {}
    for s in specs:
        if s.key in seen:
            raise ConfigSpecError(
                f"configs {seen[s.key]!r} and {s.label!r} are the same configuration",
                hint="list each configuration once",
            )
        seen[s.key] = s.label
    return specs


def find_config(specs: Sequence[ConfigSpec], text: str, dtype: str = "auto") -> ConfigSpec:
    """The spec among `specs` that `text` describes (compared by meaning, not spelling)."""
    wanted = parse_config_spec(text, dtype)
    for s in specs:
        if s.key == wanted.key:
            return s
    raise ConfigSpecError(
        f"config {text!r} is not one of the configs of this run",
        hint=f"choose from {', '.join(s.label for s in specs)}",
    )


@dataclass(frozen=True, slots=True)
class Arm:
    """One (config, mode) pair of a benchmark, and the label it is reported under."""

    mode: str  # a session mode or a baseline (hf-generate, hf-assisted)
    config: str  # the config's label
    label: str  # `mode` when the run has one config, else `mode@config`

    @property
    def baseline(self) -> bool:
        return self.mode in BASELINES


def make_arms(
    configs: Sequence[str], modes: Sequence[str], baselines: Sequence[str], baseline_config: str
) -> list[Arm]:
    """Every session mode on every config, then the baselines on `baseline_config`.

    Labels carry the config (`spec@int8/int4`) only when there are several configs,
    so a one-config run keeps the plain mode names of earlier results.
    """
    several = len(configs) > 1

    def arm(mode: str, config: str) -> Arm:
        return Arm(mode, config, f"{mode}@{config}" if several else mode)

    arms = [arm(m, c) for c in configs for m in modes]
    return arms + [arm(b, baseline_config) for b in baselines]


def find_arm(
    arms: Sequence[Arm], text: str, specs: Sequence[ConfigSpec] = (), dtype: str = "auto"
) -> Arm:
    """The arm `text` names: a label, or `mode@config` with the config in any spelling
    `find_config` accepts (`specs` given, parsed with default dtype `dtype`)."""
    for a in arms:
        if a.label == text.strip():
            return a
    mode, sep, config = text.strip().partition("@")
    if sep and specs:
        try:
            label = find_config(specs, config, dtype).label
        except ConfigSpecError:
            label = None
        for a in arms:
            if a.mode == mode and a.config == label:
                return a
    raise ConfigSpecError(
        f"arm {text!r} is not in this run", hint=f"choose from {', '.join(a.label for a in arms)}"
    )


# -- prompts -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One prompt: the last user message, with what came before it."""

    id: str
    kind: str
    prompt: str
    history: tuple[tuple[str, str], ...] = ()  # earlier (role, content) turns
    system: str | None = None

    @property
    def messages(self) -> list[tuple[str, str]]:
        return [*self.history, ("user", self.prompt)]


def parse_prompt(data: object, where: str) -> BenchPrompt:
    """One JSON object {"id", "kind", "messages": [{"role", "content"}, ...]}."""
    if not isinstance(data, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f'{where}: "messages" must be a non-empty list')
    turns: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptFileError(f"{where}: message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise PromptFileError(
                f"{where}: message {i} has role {role!r}; expected one of {ROLES}"
            )
        if not isinstance(content, str):
            raise PromptFileError(f'{where}: message {i} has no string "content"')
        turns.append((role, content))
    system = None
    if turns[0][0] == "system":
        system = turns.pop(0)[1]
    if any(r == "system" for r, _ in turns):
        raise PromptFileError(f"{where}: a system message may only come first")
    if not turns or turns[-1][0] != "user":
        raise PromptFileError(f"{where}: the last message must be the user's")
    pid = data.get("id", where)
    kind = data.get("kind", "default")
    if not isinstance(pid, str | int) or not isinstance(kind, str):
        raise PromptFileError(f'{where}: "id" must be a string or number and "kind" a string')
    return BenchPrompt(str(pid), kind, turns[-1][1], tuple(turns[:-1]), system)


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a JSONL prompt file; errors name the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PromptFileError(f"cannot read the prompt file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{path} is not UTF-8 text") from exc
    prompts: list[BenchPrompt] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{n}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(
                f"{where}: not valid JSON ({exc.msg} at column {exc.colno})",
                hint='each line must be {"id": ..., "kind": ..., "messages": [{"role": ..., "content": ...}]}',
            ) from exc
        p = parse_prompt(data, where)
        if p.id in seen:
            raise PromptFileError(f"{where}: duplicate prompt id {p.id!r}")
        seen.add(p.id)
        prompts.append(p)
    if not prompts:
        raise PromptFileError(f"{path} holds no prompts")
    return prompts


# -- one run -----------------------------------------------------------------------


@dataclass(slots=True)
class RunRecord:
    """Everything measured in one (arm, prompt, repeat) run."""

    arm: str
    prompt_id: str
    kind: str
    repeat: int
    block: int  # index of the (repeat, prompt) block; -1 for warm-up
    slot: int  # position of the run in its block
    status: str = "ok"  # "ok" | "unavailable" | "failed"
    mode_ran: str | None = None  # TurnStats.mode for session arms
    prompt_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    seconds: float = 0.0  # submit -> last token
    ttft_s: float | None = None
    latencies_ms: list[float] = field(default_factory=list)  # per token, after the first emission
    chunks: list[int] = field(default_factory=list)  # tokens per emission (round or streamer put)
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (k, accepted) speculative rounds
    # (draft ms, verify ms) of each speculative round, and the controller's plain
    # target step: the costs c and v as the reply paid them (not as measured at load)
    spec_costs: list[tuple[float, float]] = field(default_factory=list)
    catch_up_ms: float = 0.0  # the draft's catch-up passes before those rounds, summed
    target_step_ms: float | None = None
    exit_layers: list[int] = field(default_factory=list)
    early_exits: int = 0
    mean_layers: float | None = None
    fallbacks: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    stop_reason: str = ""
    rss_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    error: str | None = None
    config: str = ""  # label of the model configuration the arm ran on
    # a served engine's figures for the reply (the server arm): drafts (verify steps),
    # draft tokens, accepted tokens, and "reply" or "server-wide"
    server: dict[str, Any] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float | None:
        return self.n_tokens / self.seconds if self.ok and self.seconds > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first emission."""
        if not self.ok or self.ttft_s is None or self.n_tokens < 2:
            return None
        rest = self.seconds - self.ttft_s
        return (self.n_tokens - self.chunks[0]) / rest if self.chunks and rest > 0 else None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_s"] = self.tokens_per_s
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        return out


def _chunk_latencies(
    t0: float, emits: Sequence[tuple[float, int]]
) -> tuple[float | None, list[float]]:
    """(time to first token, per-token latencies in ms) from (time, tokens) emissions."""
    if not emits:
        return None, []
    lat: list[float] = []
    for (t_prev, _), (t, n) in zip(emits, emits[1:], strict=False):
        if n:
            lat.extend([(t - t_prev) * 1e3 / n] * n)
    return emits[0][0] - t0, lat


class Memory:
    """Peak memory of one run: RSS after it (psutil), torch's CUDA peak during it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.process = psutil.Process(os.getpid()) if psutil is not None else None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self, rec: RunRecord) -> None:
        if self.process is not None:
            rec.rss_bytes = int(self.process.memory_info().rss)
        if self.cuda:
            rec.cuda_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))


def fresh_conversation(session: ChatSession, prompt: BenchPrompt, system: str | None) -> None:
    """A new conversation holding the prompt's earlier turns, with empty caches: the next
    turn prefills the whole conversation, whatever the previous run left behind."""
    session.system_prompt = prompt.system if prompt.system is not None else system
    session.reset(prompt.history, drop_caches=True)


def arm_config(arm: str, cfg: DecodeConfig) -> DecodeConfig:
    """The decoding settings of a session arm: a mode, or spec with the draft model alone."""
    if arm in SPEC_VARIANTS:
        return cfg.with_(mode=Mode.SPEC, **SPEC_VARIANTS[arm])
    return cfg.with_(mode=Mode(arm))


def run_session_arm(
    session: ChatSession,
    prompt: BenchPrompt,
    arm: str,
    cfg: DecodeConfig,
    rec: RunRecord,
    memory: Memory,
    telemetry: Telemetry | None = None,
) -> RunRecord:
    """Decode `prompt` in mode `arm` and fill `rec`."""
    cfg = arm_config(arm, cfg)
    mode = cfg.mode
    model_name = session.target.info.name
    emits: list[tuple[float, int]] = []
    round_tokens = 0
    last_t = 0.0
    stats = None
    memory.start()
    t0 = time.perf_counter()
    for ev in session.stream(prompt.prompt, cfg):
        if telemetry is not None:
            telemetry.observe(ev, model=model_name, mode=rec.arm)
        if isinstance(ev, TokenEvent):
            rec.tokens.append(ev.token_id)
            round_tokens += 1
            if ev.exit_layer is not None:
                rec.exit_layers.append(ev.exit_layer)
            last_t = ev.t
        elif isinstance(ev, RoundEvent):
            if round_tokens:
                emits.append((last_t, round_tokens))
            round_tokens = 0
            if ev.k > 0:
                rec.rounds.append((ev.k, ev.accepted))
                rec.spec_costs.append((ev.draft_ms, ev.verify_ms))
                rec.catch_up_ms += ev.catch_up_ms
            if ev.target_step_ms:
                rec.target_step_ms = ev.target_step_ms
        elif isinstance(ev, TurnStarted):
            rec.prompt_tokens = ev.prompt_tokens
        elif isinstance(ev, Notice):
            rec.notices.append(ev.message)
        elif isinstance(ev, TurnFinished):
            stats = ev.stats
        elif isinstance(ev, Failed):
            rec.status, rec.error = "failed", f"{ev.message} ({ev.hint})" if ev.hint else ev.message
    t_end = time.perf_counter()
    memory.stop(rec)
    if round_tokens:  # tokens after the last RoundEvent (none in practice)
        emits.append((last_t, round_tokens))
    rec.chunks = [n for _, n in emits]
    rec.ttft_s, rec.latencies_ms = _chunk_latencies(t0, emits)
    rec.seconds = (emits[-1][0] if emits else t_end) - t0
    if stats is not None:
        rec.mode_ran = stats.mode.value
        rec.text = stats.text
        rec.stop_reason = stats.stop_reason
        rec.early_exits = stats.early_exits
        rec.mean_layers = stats.mean_layers
        rec.fallbacks = list(stats.fallbacks)
        if stats.mode is not mode:
            rec.status = "unavailable"
            rec.error = "; ".join(rec.notices) or f"the session ran {stats.mode.value}"
    elif rec.ok:
        rec.status, rec.error = "failed", "the reply did not finish"
    return rec


def run_server_arm(
    remote: Any,
    prompt: BenchPrompt,
    cfg: DecodeConfig,
    rec: RunRecord,
    telemetry: Telemetry | None = None,
) -> RunRecord:
    """Send `prompt` (its earlier turns too) to a served engine (`RemoteSession`) and
    fill `rec`: a chunk of its stream is one emission; its figures are the server's."""
    remote.system_prompt = prompt.system
    remote.reset(prompt.history)
    emits: list[tuple[float, int]] = []
    stats = None
    t0 = time.perf_counter()
    for ev in remote.stream(prompt.prompt, cfg):
        if telemetry is not None:
            telemetry.observe(ev, model=remote.ready.target.name, mode=rec.arm)
        if isinstance(ev, TokenEvent):
            rec.tokens.append(ev.token_id)
            emits.append((ev.t, 1))
        elif isinstance(ev, TurnFinished):
            stats = ev.stats
        elif isinstance(ev, Failed):
            rec.status, rec.error = "failed", f"{ev.message} ({ev.hint})" if ev.hint else ev.message
    merged: list[tuple[float, int]] = []
    for t, n in emits:  # the tokens of one chunk share its arrival time
        if merged and merged[-1][0] == t:
            merged[-1] = (t, merged[-1][1] + n)
        else:
            merged.append((t, n))
    rec.chunks = [n for _, n in merged]
    rec.ttft_s, rec.latencies_ms = _chunk_latencies(t0, merged)
    rec.seconds = (merged[-1][0] if merged else time.perf_counter()) - t0
    if stats is not None:
        rec.mode_ran = stats.mode.value
        rec.text = stats.text
        rec.stop_reason = stats.stop_reason
        server = stats.server
        if server is not None:
            rec.server = {"drafts": server.drafts, "draft_tokens": server.draft_tokens,
                          "accepted": server.accepted, "scope": server.scope,
                          "source": server.source, "speculative": server.speculative}  # fmt: skip
    elif rec.ok:
        rec.status, rec.error = "failed", "the reply did not finish"
    return rec


# -- the transformers baselines ------------------------------------------------------


class _ChunkTimer:
    """A transformers streamer recording when each chunk of new tokens arrives."""

    def __init__(self) -> None:
        self.emits: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.emits.append((now, int(value.numel())))

    def end(self) -> None:
        pass


def hf_generation_config(target: LoadedModel, cfg: DecodeConfig, max_new_tokens: int) -> Any:
    """Every setting that matters spelled out, so the checkpoint's defaults
    (a repetition penalty, sampling) cannot change what `generate` does."""
    from transformers import GenerationConfig

    eos = sorted(target.eos_ids)
    pad = target.tokenizer.pad_token_id
    sampling = not cfg.greedy
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=cfg.temperature if sampling else 1.0,
        top_k=cfg.top_k if sampling else 0,
        top_p=cfg.top_p if sampling else 1.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        eos_token_id=eos or None,
        pad_token_id=pad if pad is not None else (eos[0] if eos else None),
        use_cache=True,
    )


def run_hf_arm(
    session: ChatSession,
    prompt: BenchPrompt,
    arm: str,
    cfg: DecodeConfig,
    rec: RunRecord,
    memory: Memory,
    seed: int | None,
    telemetry: Telemetry | None = None,
) -> RunRecord:
    """transformers `generate` (plain or assisted) on the session's own model objects."""
    if arm == HF_ASSISTED and session.draft is None:
        rec.status, rec.error = "unavailable", "no draft model is loaded"
        return rec
    target: Any = session.target.model
    gen_cfg = hf_generation_config(session.target, cfg, cfg.max_new_tokens)
    extra: dict[str, Any] = {}
    if arm == HF_ASSISTED:
        assert session.draft is not None
        extra["assistant_model"] = session.draft.model
    timer = _ChunkTimer()
    if seed is not None:
        torch.manual_seed(seed)
    memory.start()
    t0 = time.perf_counter()
    ids = session.render(prompt.messages)
    input_ids = torch.tensor([ids], dtype=torch.long, device=session.target.device)
    try:
        with torch.inference_mode():
            out = target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=gen_cfg,
                streamer=timer,
                **extra,
            )
    except Exception as exc:  # a baseline failing must not end the benchmark
        rec.status, rec.error = "failed", f"{type(exc).__name__}: {exc}"
        return rec
    t_end = time.perf_counter()
    memory.stop(rec)
    rec.prompt_tokens = len(ids)
    rec.tokens = [int(t) for t in out[0, len(ids) :].tolist()]
    rec.mode_ran = arm
    rec.text = session.tokenizer.decode(rec.tokens, skip_special_tokens=True)
    rec.chunks = [n for _, n in timer.emits]
    rec.ttft_s, rec.latencies_ms = _chunk_latencies(t0, timer.emits)
    rec.seconds = (timer.emits[-1][0] if timer.emits else t_end) - t0
    eos = set(gen_cfg.eos_token_id or [])
    rec.stop_reason = "eos" if rec.tokens and rec.tokens[-1] in eos else "max_tokens"
    if telemetry is not None:
        telemetry.observe_run(
            model=session.target.info.name,
            mode=rec.arm,
            tokens=rec.n_tokens,
            ttft_s=rec.ttft_s,
            latencies_s=[v / 1e3 for v in rec.latencies_ms],
            seconds=rec.seconds,
        )
    return rec


def hf_assistant_settings(session: ChatSession) -> dict[str, Any] | None:
    """What transformers' assisted generation will use (read from the draft's generation config)."""
    if session.draft is None:
        return None
    g = session.draft.model.generation_config
    defaults = (
        g._get_default_generation_params() if hasattr(g, "_get_default_generation_params") else {}
    )
    keys = (
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
    )
    return {
        k: getattr(g, k, None) if getattr(g, k, None) is not None else defaults.get(k) for k in keys
    }
