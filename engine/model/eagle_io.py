"""Draft heads on disk, in the `speculators` EAGLE-3 layout vLLM serves.

A head folder holds:

- `config.json`: `speculators_model_type: "eagle3"`, `architectures`,
  `transformer_layer_config` (a Llama decoder layer's config: sizes, heads,
  `rms_norm_eps`, `rope_theta`, the *target's* `vocab_size`),
  `draft_vocab_size`, `norm_before_residual` (always written: speculators
  reads a missing one as false, vLLM as true), `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`, and `speculators_config` (`algorithm`,
  one greedy `proposal_methods` entry with `speculative_tokens`,
  `default_proposal_method`, `verifier` {`name_or_path`, `architectures`}:
  vLLM requires the verifier's name), and `fc_norm` (each feature layer
  RMS-normed before `fc`, weights `fc_norm.{i}.weight` [Ht]: a field of
  speculators' trainer and of SGLang-derived servers; a server that does not
  know it would run such a head without the norms).
- `model.safetensors`: `fc.weight` [H, 3 Ht], `layers.0.*` (q/k/v read 2H),
  `norm.weight`, `lm_head.weight` [Vd, H], `d2t` int64 [Vd], `t2d` bool [Vt].
  No `embed_tokens.weight`: the verifier's embedding is used, as vLLM does
  when a checkpoint has none (a published head's copy of it is not read).
  `midlayer.` names (EAGLE's own checkpoints) read as `layers.0.`.
- `specchat.json`: what the layout has no field for: the target weights'
  SHA-256 (a head is refused for other weights), what training saw and its
  validation report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import EngineError
from .eagle import EagleHead, HeadConfig, default_aux_layers

WEIGHTS = "model.safetensors"
FACTS = "specchat.json"
SPECULATIVE_TOKENS = 3  # what a server drafts per step by default with this head


def speculators_config(c: HeadConfig, verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    """config.json for a head, in speculators' EAGLE-3 fields."""
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": c.target_vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "fc_norm": c.fc_norm,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": SPECULATIVE_TOKENS,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": c.target_name or None,
                "architectures": verifier_architectures or [],
            },
        },
        "speculators_version": "0.3.0",
    }


def config_from_speculators(raw: dict[str, Any], num_target_layers: int | None = None) -> HeadConfig:
    """A HeadConfig from a speculators EAGLE-3 config.json (ours or a published one)."""
    if raw.get("speculators_model_type") != "eagle3":
        kind = raw.get("speculators_model_type")
        raise ValueError(f"not an EAGLE-3 head (speculators_model_type {kind!r})")
    layer = raw.get("transformer_layer_config") or {}
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"heads of {layer['num_hidden_layers']} layers are not supported (one)")
    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    scaling = layer.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind not in (None, "default"):
        raise ValueError(f"its rotary scaling ({kind}) is not supported: only plain rotary")
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        if num_target_layers is None:
            raise ValueError("the head names no feature layers and the target is unknown")
        aux = list(default_aux_layers(num_target_layers))
    theta = layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    return HeadConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(layer["intermediate_size"]),
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        target_vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
        aux_layers=tuple(int(i) for i in aux),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(layer.get("max_position_embeddings", 32768)),
        norm_before_residual=bool(raw.get("norm_before_residual", True)),  # vLLM's reading
        fc_norm=bool(raw.get("fc_norm", False)),
        target_name=str(verifier.get("name_or_path") or ""),
    )


def save_head(head: EagleHead, folder: Path | str, facts: dict[str, Any] | None = None,
              verifier_architectures: list[str] | None = None) -> Path:
    """Write the head (config.json, model.safetensors, specchat.json) into folder, atomically
    file by file; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        name: t.detach().to("cpu").contiguous()
        for name, t in head.state_dict().items()
        if name != "inv_freq"
    }
    _atomic(folder / WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    config = speculators_config(head.config, verifier_architectures)
    _atomic(folder / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    own = {"target_sha256": head.config.target_sha256, **(facts or {})}
    _atomic(folder / FACTS, lambda p: p.write_text(json.dumps(own, indent=2) + "\n"))
    return folder


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    write(tmp)
    os.replace(tmp, path)


def head_facts(folder: Path | str) -> dict[str, Any]:
    path = Path(folder) / FACTS
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def load_head(
    folder: Path | str,
    *,
    target_sha256: str | None = None,
    target_config: Any = None,
    device: torch.device | str = "cpu",
) -> EagleHead:
    """The head saved in folder, checked against the target it will draft for.

    Raises EngineError with a hint: a missing or corrupt file, another layout,
    a head made for other weights (its SHA-256 against `target_sha256`) or
    for another shape of target (`target_config`: hidden size, vocabulary, depth).
    """
    folder = Path(folder)
    hint = f"train one with `specchat train-draft`, or check {folder}"
    if not (folder / "config.json").is_file() or not (folder / WEIGHTS).is_file():
        raise EngineError(f"no draft head in {folder} (config.json and {WEIGHTS} needed)", hint=hint)
    try:
        raw = json.loads((folder / "config.json").read_text())
        layers = int(target_config.num_hidden_layers) if target_config is not None else None
        config = config_from_speculators(raw, layers)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"the draft head's config.json in {folder} is not usable: {exc}", hint=hint) from exc
    facts = head_facts(folder)
    made_for = str(facts.get("target_sha256") or "")
    if made_for and target_sha256 and made_for != target_sha256:
        raise EngineError(
            f"the draft head in {folder} was trained on other weights "
            f"(sha256 {made_for[:12]}…, this target's is {target_sha256[:12]}…)",
            hint="train a head for this target with `specchat train-draft --target ...`",
        )
    if target_config is not None:
        _check_shape(config, target_config, folder)
    config = _with(config, target_sha256=made_for)
    try:
        state = load_file(str(folder / WEIGHTS), device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a torn file
        raise EngineError(f"the draft head's weights in {folder} cannot be read: {exc}", hint=hint) from exc
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    # speculators saves a frozen copy of the verifier's embedding; the verifier's own is used.
    state.pop("embed_tokens.weight", None)
    head = EagleHead(config)
    if "d2t" not in state and config.draft_vocab_size == config.target_vocab_size:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)  # the identity
    try:
        if "t2d" not in state and "d2t" in state:  # vLLM does not read t2d: rebuild it
            state["t2d"] = torch.zeros(config.target_vocab_size, dtype=torch.bool)
            state["t2d"][torch.arange(config.draft_vocab_size) + state["d2t"].long()] = True
        head.load_state_dict(state)
    except (RuntimeError, KeyError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise EngineError(f"the draft head's weights in {folder} do not fit its config: {first}", hint=hint) from exc
    return head.to(device).eval().requires_grad_(False)


def _with(c: HeadConfig, **changes: Any) -> HeadConfig:
    from dataclasses import replace

    return replace(c, **changes)


def _check_shape(c: HeadConfig, target: Any, folder: Path) -> None:
    layers = int(target.num_hidden_layers)
    problems = []
    if c.target_hidden_size != int(target.hidden_size):
        problems.append(f"target hidden size {c.target_hidden_size}, this target's {target.hidden_size}")
    if c.target_vocab_size != int(target.vocab_size):
        problems.append(f"vocabulary {c.target_vocab_size}, this target's {target.vocab_size}")
    if any(not 0 <= i < layers for i in c.aux_layers):
        problems.append(f"feature layers {list(c.aux_layers)} outside this target's {layers}")
    if problems:
        raise EngineError(
            f"the draft head in {folder} does not fit this target: " + "; ".join(problems),
            hint="train a head for this target with `specchat train-draft --target ...`",
        )


def for_decoding(head: EagleHead, device: torch.device) -> tuple[EagleHead, str]:
    """The head ready to draft on `device`, and what was chosen.

    On the CPU its projections take the w4a8 kernel where it runs here and the
    shapes fit (a draft step reads a quarter of the float32 bytes: the head's
    step is memory-bound as the target's is); elsewhere they stay float.
    """
    head = head.to(device).eval().requires_grad_(False)
    if device.type != "cpu":
        return head, f"float on {device}"
    from .qlinear import W4A8_IN_MULTIPLE, W4A8Linear

    try:
        from . import native

        native.load("w4a8")
    except Exception as exc:  # no compiler, not x86: the float head still drafts
        return head, f"float32 (the w4a8 kernel is unavailable: {str(exc).splitlines()[0]})"
    swapped = 0
    for module in list(head.modules()):
        for name, child in list(module.named_children()):
            if (
                isinstance(child, torch.nn.Linear)
                and child.in_features % W4A8_IN_MULTIPLE == 0
                and child.out_features % 8 == 0
            ):
                setattr(module, name, W4A8Linear(child))
                swapped += 1
    return head, f"w4a8 ({swapped} projections)"


def find_head(weights_sha256: str | None, cache_dir: Path | str | None = None) -> Path | None:
    """The head `specchat train-draft` saved for these weights, if any."""
    from .. import paths

    if not weights_sha256:
        return None
    folder = paths.heads_dir(cache_dir) / weights_sha256[:20]
    return folder if (folder / WEIGHTS).is_file() else None
