"""Flags shared by the subcommands, and their translation into engine configs."""

from __future__ import annotations

import argparse
from importlib import metadata

from specchat.engine.config import LOCAL_MODES, DecodeConfig, Mode, ModelSpec, QuantMode


def version() -> str:
    try:
        return metadata.version("specchat")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("served engine (instead of local models)")
    g.add_argument(
        "--server",
        metavar="URL",
        help="chat with a vLLM, SGLang or llama.cpp server over its OpenAI-compatible API "
        "(e.g. http://127.0.0.1:8080); its acceptance comes from its metrics",
    )
    g.add_argument(
        "--server-kind",
        default="auto",
        choices=["auto", "vllm", "sglang", "llama.cpp"],
        help="which engine serves (auto: asked of the server)",
    )
    g.add_argument("--model", default=None, help="the served model to use (default: the first it lists)")
    g.add_argument(
        "--api-key-env",
        default=None,
        metavar="VAR",
        help="environment variable holding the server's API key (none is sent without it)",
    )


def connect_server(args: argparse.Namespace, progress=None, system_prompt: str | None = None):  # type: ignore[no-untyped-def]
    """The RemoteSession the --server flags ask for (EngineError when it cannot be had)."""
    from specchat.engine.remote.session import RemoteSession

    return RemoteSession.connect(
        args.server,
        kind=args.server_kind,
        model=args.model,
        api_key_env=args.api_key_env,
        system_prompt=system_prompt,
        progress=progress,
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument(
        "--target",
        help="target model: preset name, Hugging Face id, model folder or .gguf file "
        "(default: the default pair's target)",
    )
    g.add_argument(
        "--draft",
        help="draft model, same forms as --target; 'none' for no draft "
        "(default: the default pair's draft)",
    )
    quants = ["auto", *(q.value for q in QuantMode)]
    g.add_argument(
        "--target-quant",
        choices=quants,
        default="auto",
        help="target quantization (auto: w4a8 on x86 CPUs with AVX2, else w8a8; bnb-nf4 on CUDA; "
        "small models stay as loaded)",
    )
    g.add_argument(
        "--draft-quant",
        choices=quants,
        default="auto",
        help="draft quantization (auto: as the target, but w4a8-g128 where the target takes w4a8)",
    )
    g.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="draft head scores only the N most frequent token ids and the special "
        "tokens (cheaper drafts; output stays exact)",
    )
    g.add_argument(
        "--draft-head",
        default="auto",
        metavar="PATH_OR_ID",
        help="draft head for --mode eagle: a folder in the speculators EAGLE-3 layout, a "
        "Hugging Face id, 'auto' (the head `specchat train-draft` saved for this target) "
        "or 'none'",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights dtype (auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--cache-dir",
        default=None,
        help="model cache (default: $SPECCHAT_CACHE or ~/.cache/specchat)",
    )
    g.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: all cores)"
    )


def add_decode_args(p: argparse.ArgumentParser, *, mode_default: str | None = None) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--mode", choices=[m.value for m in LOCAL_MODES], default=mode_default)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument(
        "--k", type=int, default=None, help="force K draft tokens per round (default: adaptive)"
    )
    g.add_argument(
        "--no-compose",
        dest="compose",
        action="store_false",
        default=None,
        help="spec: draft with the draft model alone (default: prompt lookup first, "
        "the draft model where it finds nothing)",
    )
    g.add_argument(
        "--siblings",
        type=int,
        default=None,
        metavar="S",
        help="spec: verify the draft's second guess beside its first at depths 1..S, a "
        "draft tree (0: a chain alone; default: the controller chooses where the measured "
        "costs say a tree pays)",
    )
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument(
        "--exit-threshold", type=float, default=None, help="early exit confidence threshold"
    )
    g.add_argument("--exit-layer", type=int, default=None, help="self-spec draft depth in layers")


def decode_config(args: argparse.Namespace, base: DecodeConfig | None = None) -> DecodeConfig:
    """Flags given on the command line override `base` (settings file or defaults)."""
    cfg = base or DecodeConfig()
    changes: dict[str, object] = {}
    for flag, fld in [
        ("mode", "mode"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("k", "k"),
        ("compose", "compose"),
        ("siblings", "siblings"),
        ("max_new_tokens", "max_new_tokens"),
        ("seed", "seed"),
        ("exit_threshold", "exit_threshold"),
        ("exit_layer", "exit_layer"),
    ]:
        value = getattr(args, flag, None)
        if value is not None:
            changes[fld] = Mode(value) if fld == "mode" else value
    if getattr(args, "stop", None):
        changes["stop"] = tuple(args.stop)
    return cfg.with_(**changes) if changes else cfg  # ValueError: a flag out of range


def _quant(flag: str | None) -> QuantMode | None:
    return None if flag in (None, "auto") else QuantMode(flag)


def model_specs(args: argparse.Namespace) -> tuple[ModelSpec, ModelSpec | None]:
    """Target and draft specs from the flags; presets fill what is not given."""
    from specchat.engine.weights import registry

    target_src = args.target or registry.DEFAULT_PAIR[0]
    if args.draft is not None:
        draft_src: str | None = None if args.draft.lower() == "none" else args.draft
    elif args.target is None:
        draft_src = registry.DEFAULT_PAIR[1]
    else:
        draft_src = None
    target = ModelSpec(
        target_src,
        quant=_quant(args.target_quant),
        dtype=args.dtype,
        device=args.device,
    )
    draft = (
        ModelSpec(
            draft_src,
            quant=_quant(args.draft_quant),
            dtype=args.dtype,
            device=args.device,
            head_shortlist=getattr(args, "draft_vocab", None) or 0,
        )
        if draft_src
        else None
    )
    return target, draft


def fail(message: str, hint: str = "") -> int:
    """Print an error for the user (no traceback) and return the exit status."""
    import sys

    print(f"specchat: error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
    return 2
