"""When early exit leaves, and the calibration that decides it, per model.

`ExitPolicy` says where to look and when to leave (CALM, Schuster et al. 2022).
A `Calibration` holds, for one model's weights, the confidence measures and the
top-1 agreement with the full model at every exit layer over a calibration
set; any agreement budget turns into a policy when it is loaded:
`load_calibration(target).policy(budget)`. `policy_for` picks the policy a turn
runs with. Making a calibration (running the target over prompts) is a tool:
tools/calibration.py.

The full target runs over a prompt set (and a short greedy continuation of
each, so the positions include the model's own outputs). At every position
and exit layer we record the confidence measures and whether the exit
layer's top-1 token equals the full model's. A threshold per layer is then
the lowest one whose exit set keeps top-1 agreement at or above the budget
(CALM's "consistency" with the full model, Schuster et al. 2022, here
measured on a calibration set rather than guaranteed by a statistical test).
Raising the budget can only raise a threshold.

Files live in the cache (engine/paths.py) under `calibration/<weights hash>.json`.

A caveat stated once: calibration sees hidden states computed with the
full cache, while at decode time the K/V of skipped layers are filled from
the exit state; positions after an exit therefore differ slightly from
what was calibrated (the usual CALM approximation).
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import DecodeConfig
from ..paths import calibration_dir

if TYPE_CHECKING:
    from ..weights.loading import LoadedModel

FORMAT = 1
# Pre-check candidates: these quantiles of the saturation of a layer's calibrated exits.
GATE_QUANTILES = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5)
MAX_ROUNDS = 8
OFF = math.inf  # "never exit here"



# Used when the model has no calibration and no --exit-threshold was given:
# strict, because an uncalibrated exit layer can be confidently wrong.
DEFAULT_THRESHOLD = 0.99


class Measure(StrEnum):
    """What decides an exit (see the module docstring for the costs)."""

    SOFTMAX = "softmax"  # top-1 probability
    MARGIN = "margin"  # top-1 minus top-2 probability
    SATURATION = "saturation"  # cosine(hidden at this exit point, hidden at the previous one)


def default_exit_layers(num_layers: int) -> tuple[int, ...]:
    """Every quarter: 7, 14, 21 of 28; 1, 2, 3 of 4. Counted in layers executed."""
    points = {num_layers * q // 4 for q in (1, 2, 3)}
    return tuple(sorted(p for p in points if 1 <= p < num_layers))


def exits_at(confidence: float, threshold: float) -> bool:
    """The exit rule. A threshold of 1.0 or more means never (a probability can reach 1.0)."""
    return threshold < 1.0 and confidence >= threshold


@dataclass(frozen=True, slots=True)
class ExitPolicy:
    """Where to look and when to leave.

    `layers` are exit points counted in layers executed (1..L-1, increasing);
    `thresholds[i]` applies at `layers[i]` (>= 1.0: never exit there);
    `gates[i]`, for SOFTMAX and MARGIN, is the saturation pre-check: the LM
    head is computed at `layers[i]` only when saturation >= gates[i].
    """

    layers: tuple[int, ...]
    thresholds: tuple[float, ...]
    measure: Measure = Measure.SOFTMAX
    gates: tuple[float, ...] | None = None
    source: str = "default"  # "calibrated" | "threshold" | "default"

    def __post_init__(self) -> None:
        if len(self.thresholds) != len(self.layers):
            raise ValueError("one threshold per exit layer")
        if self.gates is not None and len(self.gates) != len(self.layers):
            raise ValueError("one gate per exit layer")
        if list(self.layers) != sorted(set(self.layers)) or (self.layers and self.layers[0] < 1):
            raise ValueError(f"exit layers must be increasing and >= 1, got {self.layers}")

    @classmethod
    def uniform(
        cls,
        layers: tuple[int, ...],
        threshold: float,
        measure: Measure = Measure.SOFTMAX,
        source: str = "threshold",
    ) -> ExitPolicy:
        return cls(layers, (threshold,) * len(layers), measure, None, source)

    @property
    def active(self) -> bool:
        return any(t < 1.0 for t in self.thresholds)


# -- where and under which name -------------------------------------------------


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
    return calibration_dir(cache_dir) / f"{key}.json"


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


def policy_for(target: LoadedModel, cfg: DecodeConfig) -> ExitPolicy:
    """The policy a turn runs with: cfg.exit_threshold (top-1 probability) if given, else
    the model's calibration at cfg.exit_budget, else DEFAULT_THRESHOLD at every quarter."""
    cal = load_calibration(target)
    layers = cal.layers if cal is not None else default_exit_layers(target.num_layers)
    if cfg.exit_threshold is not None:
        return ExitPolicy.uniform(layers, cfg.exit_threshold)
    if cal is not None:
        return cal.policy(cfg.exit_budget)
    return ExitPolicy.uniform(layers, DEFAULT_THRESHOLD, source="default")
