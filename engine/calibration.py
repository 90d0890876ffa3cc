"""Calibration of early-exit thresholds, per model, stored in the cache folder.

The full target runs over a prompt set (and a short greedy continuation of
each, so the positions include the model's own outputs). At every position
and exit layer we record the confidence measures and whether the exit
layer's top-1 token equals the full model's. A threshold per layer is then
the lowest one whose exit set keeps top-1 agreement at or above the budget
(CALM's "consistency" with the full model, Schuster et al. 2022, here
measured on a calibration set rather than guaranteed by a statistical test).
Raising the budget can only raise a threshold.

The records, not only the thresholds, are saved, so any budget can be
applied when the file is loaded: `load_calibration(loaded).policy(budget)`.
Files live in `$SPECCHAT_CACHE` (default ~/.cache/specchat) under
`calibration/<weights hash>.json`.

A caveat stated once: calibration sees hidden states computed with the
full cache, while at decode time the K/V of skipped layers are filled from
the exit state; positions after an exit therefore differ slightly from
what was calibrated (the usual CALM approximation).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .early_exit import ExitPolicy, LayerStack, Measure, default_exit_layers
from .events import LoadProgress
from .loading import LoadedModel
from .runner import ModelRunner

FORMAT = 1
# Pre-check candidates: these quantiles of the saturation of a layer's calibrated exits.
GATE_QUANTILES = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5)
MAX_ROUNDS = 8
OFF = math.inf  # "never exit here"

Chat = Sequence[Mapping[str, str]]


# -- where and under which name -------------------------------------------------


def cache_root() -> Path:
    env = os.environ.get("SPECCHAT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specchat"


_STATE_HASHES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def weights_key(target: LoadedModel) -> str:
    """LoadedModel.weights_sha256, or the sha256 of the state dict (names, dtypes, shapes, bytes).

    The state-dict hash reads every weight once (seconds for a 1.5B model)
    and is remembered for the life of the model object.
    """
    if target.weights_sha256:
        return target.weights_sha256
    model = target.model
    known = _STATE_HASHES.get(model)
    if known is not None:
        return known
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    key = "state-" + digest.hexdigest()
    _STATE_HASHES[model] = key
    return key


def calibration_path(key: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or cache_root()) / "calibration" / f"{key}.json"


# -- thresholds from records ------------------------------------------------------


def select_threshold(
    confidence: Sequence[float] | np.ndarray, agree: Sequence[bool] | np.ndarray, budget: float
) -> float:
    """The lowest threshold t whose exit set {confidence >= t} has agreement >= budget.

    OFF (infinity) when no threshold reaches the budget. Monotone in the
    budget: the thresholds that meet a higher budget are a subset of those
    that meet a lower one, so their minimum can only rise.
    """
    conf = np.asarray(confidence, dtype=np.float64)
    if conf.size == 0:
        return OFF
    ok = np.asarray(agree, dtype=np.float64)
    order = np.argsort(-conf, kind="stable")
    conf, ok = conf[order], ok[order]
    precision = np.cumsum(ok) / np.arange(1, conf.size + 1)  # of the top-j positions
    # A cut is only possible where the next confidence is strictly lower (ties go together).
    cut = np.append(conf[1:] < conf[:-1], True)
    feasible = np.flatnonzero(cut & (precision >= budget))
    return float(conf[feasible[-1]]) if feasible.size else OFF


@dataclass(frozen=True, slots=True, eq=False)
class LayerRecords:
    """Per calibration position at one exit layer."""

    softmax: np.ndarray  # [N] top-1 probability
    margin: np.ndarray  # [N] top-1 minus top-2 probability
    saturation: np.ndarray  # [N] cosine with the previous exit point's hidden state
    agree: np.ndarray  # [N] bool: exit top-1 == full-model top-1

    def measure(self, m: Measure) -> np.ndarray:
        return {
            Measure.SOFTMAX: self.softmax,
            Measure.MARGIN: self.margin,
            Measure.SATURATION: self.saturation,
        }[m]


@dataclass(frozen=True, slots=True)
class CalibrationSummary:
    """Budget against what it buys, for the UI and reports.

    Realised figures simulate the policy (pre-check, thresholds, first exit
    wins) on the calibration positions. `speedup` comes from the cost model
    in parameters (a decoder layer = 1; the LM head and the K/V fill in layer
    units), which is what memory-bound decoding on a CPU pays.
    """

    model: str
    measure: str
    budget: float
    layers: tuple[int, ...]
    thresholds: tuple[float | None, ...]  # None: no exit at that layer
    agreement: float  # realised top-1 agreement with the full model
    reply_agreement: float | None  # the same on the generated positions only
    exit_rate: float
    exits_by_layer: tuple[float, ...]  # share of positions leaving at each layer
    mean_layers: float
    speedup: float
    positions: int
    source: str = ""  # the file


@dataclass(frozen=True, slots=True)
class Simulation:
    agreement: float
    reply_agreement: float | None
    exits_by_layer: tuple[float, ...]
    mean_layers: float
    cost: float  # per token, in decoder-layer units, LM heads included
    baseline: float  # the full model's cost per token


@dataclass(frozen=True, slots=True, eq=False)
class Calibration:
    model: str
    weights: str
    num_layers: int
    layers: tuple[int, ...]
    records: dict[int, LayerRecords]
    reply: np.ndarray  # [N] bool: position predicts a generated token
    head_cost: float  # LM head / one decoder layer, in parameters
    fill_cost: float  # one skipped layer's K/V fill / one decoder layer
    measure: Measure = Measure.SOFTMAX
    budget: float = 0.95  # the budget asked for when calibrating (informational)
    meta: Mapping[str, Any] | None = None

    @property
    def positions(self) -> int:
        return int(self.reply.size)

    def thresholds(self, budget: float, measure: Measure | None = None) -> tuple[float, ...]:
        """Per exit layer, before the cost model prunes any; OFF where no threshold meets budget."""
        m = measure or self.measure
        return tuple(
            select_threshold(r.measure(m), r.agree, budget)
            for r in (self.records[layer] for layer in self.layers)
        )

    def gate_options(self, layer: int, threshold: float, measure: Measure) -> list[float]:
        """Candidate saturation pre-checks at one layer: none, or quantiles of its exits."""
        r = self.records[layer]
        chosen = r.saturation[r.measure(measure) >= threshold]
        options = [-math.inf]
        if chosen.size:
            options += sorted({float(np.quantile(chosen, q)) for q in GATE_QUANTILES})
        return options

    def simulate(self, policy: ExitPolicy) -> Simulation:
        n, big_l = self.positions, self.num_layers
        alive = np.ones(n, dtype=bool)
        agree = np.ones(n, dtype=bool)
        layers_run = np.full(n, float(big_l))
        cost = np.full(n, float(big_l) + self.head_cost)
        exits = []
        for i, (layer, t) in enumerate(zip(policy.layers, policy.thresholds, strict=True)):
            r = self.records[layer]
            if t >= 1.0:
                exits.append(0.0)
                continue
            if policy.measure is Measure.SATURATION:
                leave = alive & (r.saturation >= t)
            else:
                gate = policy.gates[i] if policy.gates is not None else -math.inf
                looked = alive & (r.saturation >= gate)
                leave = looked & (r.measure(policy.measure) >= t)
                cost[looked & ~leave] += self.head_cost  # a head paid for nothing
            agree[leave] = r.agree[leave]
            layers_run[leave] = layer
            cost[leave] -= (big_l - layer) * (1.0 - self.fill_cost)
            exits.append(float(leave.mean()) if n else 0.0)
            alive &= ~leave
        reply = self.reply
        return Simulation(
            agreement=float(agree.mean()) if n else 1.0,
            reply_agreement=float(agree[reply].mean()) if reply.any() else None,
            exits_by_layer=tuple(exits),
            mean_layers=float(layers_run.mean()) if n else float(big_l),
            cost=float(cost.mean()) if n else big_l + self.head_cost,
            baseline=big_l + self.head_cost,
        )

    def policy(self, budget: float, measure: Measure | None = None) -> ExitPolicy:
        """Thresholds for the budget, then the pre-checks and exit layers that pay for themselves.

        Coordinate descent on the simulated cost per token (layers run, LM
        heads at exit points, K/V fills): each exit layer in turn takes the
        pre-check (none, or a low quantile of its exits' saturation) or is
        switched off, whichever is cheapest, until nothing improves. Switching
        a layer off or tightening its pre-check only removes exits.
        """
        m = measure or self.measure
        thresholds = list(self.thresholds(budget, m))
        gates = [-math.inf] * len(thresholds)
        uses_head = m is not Measure.SATURATION

        def cost(ts: Sequence[float], gs: Sequence[float]) -> float:
            return self.simulate(ExitPolicy(self.layers, tuple(ts), m, tuple(gs))).cost

        best = cost(thresholds, gates)
        for _ in range(MAX_ROUNDS):
            improved = False
            for i, (layer, t) in enumerate(zip(self.layers, thresholds, strict=True)):
                if t >= 1.0:
                    continue
                trials = [
                    (cost(thresholds[:i] + [OFF] + thresholds[i + 1 :], gates), OFF, gates[i])
                ]
                for g in self.gate_options(layer, t, m) if uses_head else [-math.inf]:
                    trials.append((cost(thresholds, gates[:i] + [g] + gates[i + 1 :]), t, g))
                c, t_new, g_new = min(trials, key=lambda x: x[0])
                if c < best - 1e-12:
                    best, thresholds[i], gates[i], improved = c, t_new, g_new, True
            if not improved:
                break
        return ExitPolicy(
            self.layers,
            tuple(thresholds),
            m,
            tuple(g if t < 1.0 else 1.0 for g, t in zip(gates, thresholds, strict=True))
            if uses_head
            else None,
            "calibrated",
        )

    def summary(self, budget: float | None = None) -> CalibrationSummary:
        b = self.budget if budget is None else budget
        pol = self.policy(b)
        sim = self.simulate(pol)
        return CalibrationSummary(
            model=self.model,
            measure=self.measure.value,
            budget=b,
            layers=self.layers,
            thresholds=tuple(t if t < 1.0 else None for t in pol.thresholds),
            agreement=sim.agreement,
            reply_agreement=sim.reply_agreement,
            exit_rate=sum(sim.exits_by_layer),
            exits_by_layer=sim.exits_by_layer,
            mean_layers=sim.mean_layers,
            speedup=sim.baseline / sim.cost if sim.cost > 0 else 1.0,
            positions=self.positions,
            source=str((self.meta or {}).get("path", "")),
        )

    # -- storage --------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        def floats(a: np.ndarray) -> list[float]:
            return [round(float(x), 6) for x in a]

        return {
            "format": FORMAT,
            "model": self.model,
            "weights": self.weights,
            "num_layers": self.num_layers,
            "layers": list(self.layers),
            "measure": self.measure.value,
            "budget": self.budget,
            "head_cost": self.head_cost,
            "fill_cost": self.fill_cost,
            "meta": dict(self.meta or {}),
            "reply": [int(x) for x in self.reply],
            "records": {
                str(layer): {
                    "softmax": floats(r.softmax),
                    "margin": floats(r.margin),
                    "saturation": floats(r.saturation),
                    "agree": [int(x) for x in r.agree],
                }
                for layer, r in self.records.items()
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown calibration format {data.get('format')!r}")
        records = {
            int(layer): LayerRecords(
                softmax=np.asarray(r["softmax"], dtype=np.float64),
                margin=np.asarray(r["margin"], dtype=np.float64),
                saturation=np.asarray(r["saturation"], dtype=np.float64),
                agree=np.asarray(r["agree"], dtype=bool),
            )
            for layer, r in data["records"].items()
        }
        return cls(
            model=str(data["model"]),
            weights=str(data["weights"]),
            num_layers=int(data["num_layers"]),
            layers=tuple(int(x) for x in data["layers"]),
            records=records,
            reply=np.asarray(data["reply"], dtype=bool),
            head_cost=float(data["head_cost"]),
            fill_cost=float(data["fill_cost"]),
            measure=Measure(data["measure"]),
            budget=float(data["budget"]),
            meta=data.get("meta") or {},
        )

    def save(self, cache_dir: Path | None = None) -> Path:
        path = calibration_path(self.weights, cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)
        return path


_LOADED: dict[Path, tuple[int, Calibration]] = {}


def load_calibration(target: LoadedModel, cache_dir: Path | None = None) -> Calibration | None:
    """The saved calibration of this model's weights, or None. Needs no session.

    The UI gets budget against realised agreement with
    `load_calibration(session.target).summary(cfg.exit_budget)`.
    """
    path = calibration_path(weights_key(target), cache_dir)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    known = _LOADED.get(path)
    if known is not None and known[0] == mtime:
        return known[1]
    try:
        data = json.loads(path.read_text())
        data["meta"] = {**(data.get("meta") or {}), "path": str(path)}
        cal = Calibration.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if cal.num_layers != target.num_layers:
        return None
    _LOADED[path] = (mtime, cal)
    return cal


# -- collecting records -------------------------------------------------------------


def render(tokenizer: Any, messages: Chat) -> list[int]:
    """Token ids of a chat ready for the assistant's reply (as ChatSession.render does)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
        )
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids
    plain: list[int] = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    return plain


def read_prompts(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    """(id, messages) from a JSONL file of {"id", "kind", "messages"}."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        out.append((str(row.get("id", n)), list(row["messages"])))
    return out


@torch.inference_mode()
def collect(
    target: LoadedModel,
    chats: Sequence[Chat],
    *,
    layers: Sequence[int] | None = None,
    new_tokens: int = 32,
    measure: Measure = Measure.SOFTMAX,
    budget: float = 0.95,
    progress: Callable[[LoadProgress], None] | None = None,
    chunk: int = 64,
) -> Calibration:
    """Run the full target over the chats (plus greedy continuations) and record every exit layer."""
    from .session import eos_ids

    stack = LayerStack(target.model)
    big_l = stack.num_layers
    exit_layers = tuple(sorted(set(layers or default_exit_layers(big_l))))
    if not exit_layers or exit_layers[0] < 1 or exit_layers[-1] >= big_l:
        raise ValueError(f"exit layers must be in 1..{big_l - 1}, got {exit_layers}")
    eos = eos_ids(target)
    cols: dict[int, dict[str, list[np.ndarray]]] = {
        e: {"softmax": [], "margin": [], "saturation": [], "agree": []} for e in exit_layers
    }
    reply: list[np.ndarray] = []
    report = progress or (lambda _e: None)
    for n, chat in enumerate(chats):
        report(LoadProgress("calibrate", n, len(chats)))
        prompt = render(target.tokenizer, chat)
        seq = list(prompt)
        runner = ModelRunner(target.model, target.device)
        runner.prefill(seq)
        for _ in range(new_tokens):
            tok = int(torch.argmax(runner.forward(seq)[-1]))
            seq.append(tok)
            if tok in eos:
                break
        ids = torch.tensor(seq, dtype=torch.long, device=target.device).view(1, -1)
        out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states  # L+1 entries [1, S, H]; [e] = after e layers
        final = torch.argmax(out.logits[0], dim=-1)  # [S]
        prev = hidden[0][0]  # [S, H] embeddings
        for e in exit_layers:
            h = hidden[e][0]  # [S, H]
            sat = torch.nn.functional.cosine_similarity(h.float(), prev.float(), dim=-1)  # [S]
            prev = h
            for s in range(0, h.shape[0], chunk):
                probs = torch.softmax(stack.logits(h[s : s + chunk]).float(), dim=-1)  # [c, V]
                top = torch.topk(probs, 2, dim=-1)
                col = cols[e]
                col["softmax"].append(top.values[:, 0].cpu().numpy())
                col["margin"].append((top.values[:, 0] - top.values[:, 1]).cpu().numpy())
                col["agree"].append((top.indices[:, 0] == final[s : s + chunk]).cpu().numpy())
            cols[e]["saturation"].append(sat.cpu().numpy())
        reply.append(np.arange(len(seq)) >= len(prompt) - 1)
    report(LoadProgress("calibrate", len(chats), len(chats)))
    n_layer, n_head, n_fill = stack.layer_params()
    records = {
        e: LayerRecords(
            softmax=np.concatenate(c["softmax"]).astype(np.float64),
            margin=np.concatenate(c["margin"]).astype(np.float64),
            saturation=np.concatenate(c["saturation"]).astype(np.float64),
            agree=np.concatenate(c["agree"]).astype(bool),
        )
        for e, c in cols.items()
    }
    return Calibration(
        model=target.info.name,
        weights=weights_key(target),
        num_layers=big_l,
        layers=exit_layers,
        records=records,
        reply=np.concatenate(reply) if reply else np.zeros(0, dtype=bool),
        head_cost=n_head / n_layer,
        fill_cost=n_fill / n_layer,
        measure=measure,
        budget=budget,
        meta={
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "chats": len(chats),
            "new_tokens": new_tokens,
        },
    )


__all__ = [
    "Calibration",
    "CalibrationSummary",
    "LayerRecords",
    "cache_root",
    "collect",
    "load_calibration",
    "read_prompts",
    "render",
    "select_threshold",
    "weights_key",
]
