"""Load target and draft: resolve the source, pick device and dtype, quantize, check tokenizers."""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..config import ModelSpec, QuantMode
from ..errors import ModelLoadError, TokenizerMismatchError
from ..events import LoadProgress, ModelInfo
from . import packed

Progress = Callable[[LoadProgress], None]


@dataclass
class LoadedModel:
    """A model ready to decode, with what the UI and traces need to know about it."""

    model: PreTrainedModel
    tokenizer: Any  # a transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    info: ModelInfo
    weights_sha256: str | None = None

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends a reply: the generation config's, the model config's, the tokenizer's."""
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(int(v) for v in value)
        return frozenset(ids)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device {name!r} was asked for but CUDA is not available here",
            hint="use --device cpu (or auto)",
        )
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA; float32 on the CPU (exact, and bf16 GEMV is not faster on most CPUs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def default_quant(role: str, device: torch.device, params: int | None = None) -> QuantMode:
    """The quantization a model gets when none is asked for: the first of `default_quants`."""
    return default_quants(role, device, params)[0]


def default_quants(
    role: str, device: torch.device, params: int | None = None, *, runnable_only: bool = True
) -> tuple[QuantMode, ...]:
    """The quantizations to try, best first, when none is asked for; chosen by measurement.

    Decided from what this machine has (engine/model/cpu.py): a mode whose kernel the
    CPU or the torch build cannot run is left out, unless `runnable_only` is
    False, which gives the whole order so that the loader can say why each
    earlier mode was passed over. Whether a kernel can be compiled is only known
    by trying: the loader does (`_first_that_fits`).

    On CUDA, bitsandbytes 4-bit for both (bnb-int8 picks its outlier columns over
    the whole verify block, so a token's logits would depend on its neighbours
    and speculative output would drift from plain output). On x86 CPUs with
    AVX2, w4a8 for both: ~1.5x faster per token than w8a8 (half the bytes a
    weight, read by specchat's own kernel) at 96.2% top-1 agreement with float32
    on the dev prompts (w8a8: 98.4%). Where its kernel cannot be built (no
    compiler), w8a8 through fbgemm: ~2x weight-only int8, and a verify block of
    K+1 tokens costs 1.2-1.4 steps. Without fbgemm (non-x86), int8 for the target
    and int4 for the draft. Models under 50M parameters stay as loaded: their
    shapes rarely fit the kernels and they are fast anyway. Figures:
    docs/quantization.md, docs/performance.md.
    """
    if params is not None and params < 50_000_000:
        return (QuantMode.NONE,)
    if device.type == "cuda":
        return (QuantMode.BNB_NF4,)
    from ..model.native import cpu_supports

    modes: list[QuantMode] = []
    if not runnable_only or cpu_supports("w4a8") is None:
        # The draft's weights only steer what is proposed, never what is emitted, so it
        # takes the kernel's groups of 128: a step reads 15% fewer bytes (0.5B: 13.2
        # against 15.5 ms) for 84.4% agreement with the target against 85.8%.
        if role == "draft":
            modes.append(QuantMode.W4A8_G128)
        modes.append(QuantMode.W4A8)
    if not runnable_only or has_fbgemm():
        modes.append(QuantMode.W8A8)
    modes.append(QuantMode.INT4 if role == "draft" else QuantMode.INT8)
    return tuple(modes)


def _check_quant(
    mode: QuantMode, config: Any, device: torch.device, report: Progress
) -> None:
    """quant.check, saying so first when it will compile a native kernel (once per machine)."""
    from ..model import native, quant

    kernel = quant.NATIVE_KERNEL.get(mode)
    building = (
        kernel is not None and not native.is_built(kernel) and native.cpu_supports(kernel) is None
    )
    if building:
        # no fraction to show while the compiler runs: an indeterminate bar
        detail = f"{mode} kernel: compiling once for this machine (about 30 s)"
        report(LoadProgress("build", 0, None, detail=detail))
    quant.check(mode, config, device)
    if building:
        report(LoadProgress("build", 1, 1, detail=f"{mode} kernel: built"))


def _build_decoder(config: Any, device: torch.device, report: Progress) -> None:
    """Compile the native decoder kernel (engine/model/decoder.py) where it will serve, saying so.

    A failed build is not an error: decoding then runs through transformers' modules,
    and the runner says why (`ModelRunner.native_off`).
    """
    from ..errors import QuantizationError
    from ..model import decoder, native

    if device.type != "cpu" or getattr(config, "model_type", None) not in decoder.ARCHITECTURES:
        return
    building = not native.is_built("decoder")
    if building:
        detail = "decoder kernel: compiling once for this machine (about 30 s)"
        report(LoadProgress("build", 0, None, detail=detail))
    try:
        native.load("decoder")
    except QuantizationError as exc:
        report(LoadProgress("build", 1, 1, detail=f"decoder kernel: {exc.message}; using Python"))
        return
    if building:
        report(LoadProgress("build", 1, 1, detail="decoder kernel: built"))


def _first_that_fits(
    modes: tuple[QuantMode, ...], config: Any, device: torch.device, report: Progress
) -> QuantMode:
    """The first automatic choice that works here, saying why each earlier one did not."""
    from ..errors import QuantizationError

    for i, mode in enumerate(modes):
        if mode is QuantMode.NONE:
            return mode
        try:
            _check_quant(mode, config, device, report)
        except QuantizationError as exc:
            then = modes[i + 1] if i + 1 < len(modes) else QuantMode.NONE
            report(LoadProgress("quantize", 0, None, detail=f"{mode}: {exc.message}; using {then}"))
            continue
        return mode
    return QuantMode.NONE  # none fits: load as is


def has_fbgemm() -> bool:
    """Whether fbgemm, which w8a8 runs on, works here: an x86 torch build on an AVX2 CPU."""
    from ..model.cpu import fbgemm_unavailable

    return fbgemm_unavailable() is None


def set_threads(threads: int | None) -> int:
    """Torch intra-op threads: all cores unless told otherwise. Returns the count set."""
    import os

    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def _check_causal_lm(pretrained: str, gguf_file: str | None, label: str) -> Any:
    try:
        config = AutoConfig.from_pretrained(pretrained, gguf_file=gguf_file)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ModelLoadError(
            f"cannot read the model config of {label}: {_first_line(exc)}",
            hint="check that the path holds a Hugging Face model folder (config.json) or a GGUF file",
        ) from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{label} is not a causal language model (model type {config.model_type!r})",
            hint="target and draft must be decoder-only language models",
        )
    return config


KV_RESERVE_TOKENS = 4096  # KV cache room checked for before loading a model


def _check_memory(
    config: Any,
    mode: QuantMode,
    dtype: torch.dtype,
    device: torch.device,
    label: str,
    *,
    streamed: bool = False,
) -> None:
    """Refuse, before loading, a model whose weights (at their loading peak) and a
    KV cache of KV_RESERVE_TOKENS would not fit in the memory free now. The target
    loads first, so the draft's check already sees what the target holds."""
    from .memory import check_fits, estimate_peak_bytes, kv_bytes_per_token

    try:
        peak = estimate_peak_bytes(config, mode, dtype, streamed=streamed)
        kv = kv_bytes_per_token(config, dtype) * min(
            KV_RESERVE_TOKENS, int(getattr(config, "max_position_embeddings", 2048) or 2048)
        )
    except Exception:  # an architecture the estimate cannot build: load and see
        return
    check_fits(peak + kv, device, label)


def _pieces(report: Progress, role: str, mode: QuantMode, name: str) -> Callable[[int, int], None]:
    """The streamed load's progress, as the quantize stage (about every 5%, and the end)."""
    detail = f"{role}: {mode} {name}, layer by layer"

    def piece(done: int, total: int) -> None:
        if done == total or done * 20 // total != (done - 1) * 20 // total:
            report(LoadProgress("quantize", done, total, detail=detail))

    return piece


def _approx_params(config: Any) -> int:
    """Parameters from the config alone (embeddings, layers, head), before loading."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _shortlist(
    spec: ModelSpec, tokenizer: Any, config: Any, cache_dir: Path | None, report: Progress, role: str
) -> Tensor | None:
    """The ids a shortlist head scores (spec.head_shortlist of them by frequency, plus the
    special and added tokens), or None for the whole head."""
    if not spec.head_shortlist:
        return None
    from ..model.draft_head import shortlist_ids, token_ranking

    vocab = int(config.vocab_size)
    detail = f"{role}: ranking the vocabulary by the Python library's sources (once, ~5 s)"
    ranking = token_ranking(tokenizer, vocab, cache_dir, lambda: report(LoadProgress("load", 0, 1, detail=detail)))
    special = [int(i) for i in getattr(tokenizer, "all_special_ids", [])]
    special += [int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})]
    ids = shortlist_ids(vocab, spec.head_shortlist, special, ranking)
    report(LoadProgress("load", 0, 1, detail=f"{role}: head scores {ids.numel()} tokens, the most frequent"))
    return ids


def _digest(ids: Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:12]


def load_model(
    spec: ModelSpec,
    role: str,
    *,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> LoadedModel:
    """Resolve spec.source (preset, folder, .gguf, hub id) and load it to decode."""
    from . import fetch

    report = progress or (lambda _e: None)
    resolved = fetch.resolve(spec.source, cache_dir=cache_dir, progress=progress)
    label = f"{role} model {spec.source!r}"
    device = pick_device(spec.device)
    # Packed weights kept from an earlier start (packed.py): their entry holds the config
    # and tokenizer too, so a GGUF's metadata is not parsed again either.
    entry = packed.entry(resolved.weights_sha256, cache_dir) if device.type == "cpu" else None
    meta = entry if entry is not None and entry.has_metadata else None
    meta_source, meta_gguf = (str(meta.folder), None) if meta else (resolved.pretrained, resolved.gguf_file)
    config = _check_causal_lm(meta_source, meta_gguf, label)
    dtype = pick_dtype(spec.dtype, device)

    kwargs: dict[str, Any] = {"dtype": dtype}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    quant: Any = None
    mode = spec.quant
    if mode is None:
        # every mode in order: those this machine cannot run are passed over with the reason
        modes = default_quants(role, device, _approx_params(config), runnable_only=False)
        mode = _first_that_fits(modes, config, device, report)
    if mode is not QuantMode.NONE:
        from ..model import quant as quant_mod

        quant = quant_mod
        _check_quant(mode, config, device, report)
        kwargs.update(quant.load_kwargs(mode, device))

    from .stream import POST_LOAD, load_streamed, unstreamable

    # Post-load CPU modes read a folder piece by piece, quantizing as they go (stream.py):
    # the float weights of one layer at a time, not of the whole model.
    not_streamed = unstreamable(resolved.pretrained, resolved.gguf_file, config, mode, device)
    if mode not in POST_LOAD:
        entry = None  # quantized inside from_pretrained: nothing to keep
    _check_memory(config, mode, dtype, device, label, streamed=not_streamed is None)
    report(LoadProgress("load", 0, 1, detail=f"{role}: {resolved.name}"))
    # transformers' own progress bars would write over a terminal UI.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    params = None
    kept = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(meta_source, gguf_file=meta_gguf)
        shortlist = _shortlist(spec, tokenizer, config, cache_dir, report, role)
        variant = f"v{shortlist.numel()}-{_digest(shortlist)}" if shortlist is not None else ""
        kept = packed.load(entry, mode, dtype, variant) if entry is not None else None
        if kept is not None:
            model, params = kept
            detail = f"{role}: {mode} {resolved.name}, packed weights from the cache"
            report(LoadProgress("load", 0, 1, detail=detail))
        elif not_streamed is None:
            try:
                model, params = load_streamed(
                    Path(resolved.pretrained), config, mode, dtype,
                    _pieces(report, role, mode, resolved.name), resolved.gguf_file, shortlist,
                )  # fmt: skip
            except KeyError as exc:  # names this reader does not know: transformers' loader
                report(LoadProgress("load", 0, 1, detail=f"{role}: {exc.args[0]}; loading whole"))
                params = None
        if params is None:
            model = AutoModelForCausalLM.from_pretrained(resolved.pretrained, **kwargs)
    except torch.OutOfMemoryError as exc:
        from ..errors import OutOfMemoryError

        raise OutOfMemoryError(
            f"out of memory while loading the {label}",
            hint="try a quantized mode or a smaller model",
        ) from exc
    except Exception as exc:  # safetensors, GGUF and tokenizer readers raise their own types
        raise ModelLoadError(
            f"cannot load the {label}: {_first_line(exc)}",
            hint="the files may be missing or corrupt; `specchat models verify` checks presets",
        ) from exc
    if "device_map" not in kwargs:
        model.to(device)  # type: ignore[arg-type]  # in place for nn.Module
    streamed = params is not None  # streamed or from the packed cache: quantized already
    if shortlist is not None and not streamed:  # streamed, the head was cut before packing
        from ..model.draft_head import apply_shortlist

        apply_shortlist(model, shortlist)
    if params is None:
        params = sum(p.numel() for p in model.parameters())  # before packing hides them
    if quant is not None and not streamed:
        detail = f"{role}: {mode} {resolved.name}"

        def quantized(done: int, total: int) -> None:  # about every 5%, and the end
            if done == total or done * 20 // total != (done - 1) * 20 // total:
                report(LoadProgress("quantize", done, total, detail=detail))

        model = quant.apply(model, mode, progress=quantized)
    model.eval()
    model.requires_grad_(False)
    if entry is not None and kept is None:
        why = packed.save(
            entry, model, tokenizer, mode, dtype, params, spec.source, time.perf_counter() - t0, variant
        )
        done = "kept in the cache for the next start" if why is None else f"not kept ({why})"
        report(LoadProgress("cache", 1, 1, detail=f"{role}: packed weights {done}"))
    _build_decoder(config, device, report)
    report(
        LoadProgress(
            "load", 1, 1, detail=f"{role}: {resolved.name} in {time.perf_counter() - t0:.1f}s"
        )
    )
    return LoadedModel(
        model,
        tokenizer,
        device,
        dtype,
        describe(model, role, resolved.name, spec.source, device, dtype, mode, params),
        resolved.weights_sha256,
    )


def describe(
    model: PreTrainedModel,
    role: str,
    name: str,
    source: str,
    device: torch.device,
    dtype: torch.dtype,
    quant: QuantMode = QuantMode.NONE,
    params: int | None = None,
) -> ModelInfo:
    cfg = model.config
    try:
        from .memory import kv_bytes_per_token, weight_bytes

        wbytes = weight_bytes(model)
        kv = kv_bytes_per_token(cfg, dtype)
    except ImportError:  # memory accounting not available: count parameters
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = (
            2
            * cfg.num_hidden_layers
            * heads
            * head_dim
            * torch.tensor([], dtype=dtype).element_size()
        )
    return ModelInfo(
        role=role,
        name=name,
        source=source,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        quant=quant.value,
        params=params if params is not None else sum(p.numel() for p in model.parameters()),
        weight_bytes=int(wbytes),
        kv_bytes_per_token=int(kv),
        layers=int(cfg.num_hidden_layers),
        context_length=int(getattr(cfg, "max_position_embeddings", 2048) or 2048),
    )


def tokenizer_fingerprint(tok: Any) -> dict[str, Any]:
    """What must agree between target and draft: vocabulary, merges, special tokens."""
    backend = getattr(tok, "backend_tokenizer", None)
    model_json: dict[str, Any] = {}
    if backend is not None:
        model_json = json.loads(backend.to_str()).get("model", {})
    return {
        "vocab": tok.get_vocab(),
        "merges": model_json.get("merges"),
        "special": sorted((str(k), str(v)) for k, v in (tok.special_tokens_map or {}).items()),
        "added": sorted((t.content, i) for i, t in tok.added_tokens_decoder.items()),
    }


def check_tokenizers_match(target: Any, draft: Any) -> None:
    """Refuse a draft whose tokens would mean something else to the target; say what differs."""
    a, b = tokenizer_fingerprint(target), tokenizer_fingerprint(draft)
    problems: list[str] = []
    va, vb = a["vocab"], b["vocab"]
    if va != vb:
        if len(va) != len(vb):
            problems.append(f"vocabulary sizes differ ({len(va)} vs {len(vb)})")
        differing = [t for t in va if vb.get(t) != va[t]]
        if differing:
            sample = ", ".join(f"{t!r}: {va[t]} vs {vb.get(t)}" for t in differing[:3])
            problems.append(f"{len(differing)} tokens map to different ids (e.g. {sample})")
    if a["merges"] != b["merges"]:
        problems.append("BPE merges differ")
    if a["special"] != b["special"]:
        sa, sb = dict(a["special"]), dict(b["special"])
        diff = [
            f"{k}: {sa.get(k)!r} vs {sb.get(k)!r}"
            for k in sorted(set(sa) | set(sb))
            if sa.get(k) != sb.get(k)
        ]
        problems.append("special tokens differ (" + "; ".join(diff[:3]) + ")")
    if a["added"] != b["added"] and not problems:
        problems.append("added tokens differ")
    if problems:
        raise TokenizerMismatchError(
            "the target and draft tokenizers do not match: " + "; ".join(problems),
            hint="speculative decoding needs a draft from the same model family (same tokenizer); "
            "use --draft none for plain decoding",
        )


def layer_truncated(model: PreTrainedModel, n_layers: int) -> PreTrainedModel:
    """A model made of the first n_layers of `model` plus its final norm and head.

    The layers and weights are shared (no copy); only the module list and the
    config differ. Used as a cheap draft in tests and as the self-speculative draft.
    """
    total = int(model.config.num_hidden_layers)
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers must be in 1..{total}, got {n_layers}")
    small = copy.copy(model)
    small._modules = dict(model._modules)  # copy.copy shares the children dict
    small.config = copy.deepcopy(model.config)
    small.config.num_hidden_layers = n_layers
    if hasattr(small.config, "layer_types") and small.config.layer_types:
        small.config.layer_types = small.config.layer_types[:n_layers]
    inner = copy.copy(model.model)
    inner._modules = dict(model.model._modules)
    inner.config = small.config
    inner.layers = torch.nn.ModuleList(list(model.model.layers)[:n_layers])
    small.model = inner
    return small
