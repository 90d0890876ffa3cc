"""Load time and peak memory of a bigger target from a .gguf file, first and cached.

Writes a GGUF with a real model's shapes (engine/tools/shaped.py) and random Q4_K/Q6_K
blocks mixed as a Q4_K_M file mixes them (attn_v and ffn_down Q6_K in every other layer,
the output Q6_K), then loads it with specchat's loader in fresh processes: the first
load reads it tensor by tensor into the automatic CPU mode and keeps the packed model in
a cache of its own; the second reads the packed model. Peak anonymous memory is sampled
every 5 ms from outside each process (the GGUF's mapped pages are the page cache's).

    python scripts/gguf_load.py --shape 7b [--layers N] [--dir DIR] [--threads 2]

Prints a markdown table row per load (docs/performance.md, "Bigger targets"). Seconds
are the whole process: starting Python and importing torch and transformers (~3 s) included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import json, os, sys, time, torch
t0 = time.perf_counter()
torch.set_num_threads(int(sys.argv[2]))
from specchat.engine.config import ModelSpec
from specchat.engine.weights.loading import load_model
stages = []
got = load_model(ModelSpec(sys.argv[1], None, dtype="float32"), "target",
                 progress=lambda e: stages.append(e.stage))
print(json.dumps({"seconds": time.perf_counter() - t0, "quant": got.info.quant,
                  "weight_bytes": got.info.weight_bytes, "params": got.info.params,
                  "quantized": "quantize" in stages, "kept": "cache" in stages}), flush=True)
"""


def _anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(gguf: Path, cache: Path, threads: int) -> dict[str, object]:
    env = {**os.environ, "SPECCHAT_CACHE": str(cache), "SPECCHAT_PACKED_CACHE": "1",
           "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(gguf), str(threads)],
                             stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    peak = 0
    while child.poll() is None:
        peak = max(peak, _anon(child.pid))
        time.sleep(0.005)
    assert child.stdout is not None
    lines = [line for line in child.stdout.read().splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        raise SystemExit(f"the load failed (exit {child.returncode})")
    return {**json.loads(lines[-1]), "peak": peak}


def main() -> None:
    from engine.tools.shaped import QWEN_VOCAB, SHAPES
    from tests.ggufs import write_gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--dir", type=Path, default=None, help="where the GGUF and cache go (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a model folder whose tokenizer the GGUF carries (e.g. the 0.5B draft's, to chat with it)")
    ap.add_argument("--keep", action="store_true", help="keep the GGUF and its cache, and say where")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    work = Path(tempfile.mkdtemp(prefix="gguf-load-", dir=args.dir))
    try:
        gguf = work / f"{args.shape}-shaped.gguf"
        tokenizer = None
        if args.tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        t0 = time.perf_counter()
        write_gguf(gguf, hidden=shape.hidden, intermediate=shape.intermediate, layers=layers,
                   heads=shape.heads, kv_heads=shape.kv_heads, vocab=QWEN_VOCAB, tied=shape.tied,
                   tokenizer=tokenizer)  # fmt: skip
        print(f"wrote {gguf.stat().st_size / 1e9:.2f} GB ({layers} layers) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)  # fmt: skip
        cache = work / "cache"
        cache.mkdir()
        from specchat.engine import paths

        for have in (paths.kernels_dir(), paths.models_dir()):  # kernels built already are not
            if have.is_dir():  # part of a load; the presets are there for a chat with --keep
                (cache / have.name).symlink_to(have)
        first = measure(gguf, cache, args.threads)
        second = measure(gguf, cache, args.threads)
        kept = sum(f.stat().st_size for f in (cache / "packed").rglob("*") if f.is_file())
        from specchat.engine.model import cpu as cpu_mod

        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")] if Path("/proc/cpuinfo").is_file() else []  # fmt: skip
        cpu = f"{names[0] if names else platform.machine()} ({cpu_mod.features().summary()})"
        print(f"\n{args.shape}-shaped ({layers} layers), GGUF {gguf.stat().st_size / 1e9:.2f} GB, "
              f"{args.threads} threads, {cpu}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
        print("| load | mode | seconds | peak anonymous memory | weights in memory |")
        print("|---|---|---|---|---|")
        for label, r in (("first: tensor by tensor, packed, kept", first), ("second: the packed cache", second)):
            assert r["quantized"] == (r is first), r
            print(f"| {label} | {r['quant']} | {r['seconds']:.1f} | {int(r['peak']) / 1e9:.2f} GB | "
                  f"{int(r['weight_bytes']) / 1e9:.2f} GB |")  # fmt: skip
        print(f"packed entry on disk: {kept / 1e9:.2f} GB")
    finally:
        if args.keep:
            print(f"kept: {work} (chat: SPECCHAT_CACHE={work / 'cache'} specchat --target {gguf})")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
