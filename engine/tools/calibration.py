"""Calibration of early-exit thresholds: run the full target over a prompt set and record,
at every exit layer, what a policy needs (decode/exit_policy.py keeps and applies it).

The full target runs over the prompts and a short greedy continuation of each,
so the positions include the model's own outputs. At every position and exit
layer `collect` records the confidence measures and whether the exit layer's
top-1 token equals the full model's. The records, not only the thresholds, are
saved, so any budget applies when the file is loaded:
`load_calibration(loaded).policy(budget)`.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..decode.exit_policy import (
    Calibration,
    LayerRecords,
    Measure,
    default_exit_layers,
    weights_key,
)
from ..decode.text import render_chat
from ..events import LoadProgress
from ..model.layers import LayerStack
from ..model.runner import ModelRunner
from ..weights.loading import LoadedModel

Chat = Sequence[Mapping[str, str]]

# -- collecting records -------------------------------------------------------------


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
    stack = LayerStack(target.model)
    big_l = stack.num_layers
    exit_layers = tuple(sorted(set(layers or default_exit_layers(big_l))))
    if not exit_layers or exit_layers[0] < 1 or exit_layers[-1] >= big_l:
        raise ValueError(f"exit layers must be in 1..{big_l - 1}, got {exit_layers}")
    eos = target.eos_ids
    cols: dict[int, dict[str, list[np.ndarray]]] = {
        e: {"softmax": [], "margin": [], "saturation": [], "agree": []} for e in exit_layers
    }
    reply: list[np.ndarray] = []
    report = progress or (lambda _e: None)
    for n, chat in enumerate(chats):
        report(LoadProgress("calibrate", n, len(chats)))
        prompt = render_chat(target.tokenizer, chat)
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


__all__ = ["collect", "read_prompts"]
