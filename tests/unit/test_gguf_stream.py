"""A .gguf file loaded tensor by tensor (engine/weights/gguf_file.py through stream.py):
the reader dequantizes as the GGML block layouts say, Llama's q/k rows come back in
the model's order, the model equals transformers' whole load quantized, and the
float weights of the whole model are never alive at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import IO

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specchat.engine.config import ModelSpec, QuantMode
from specchat.engine.errors import QuantizationError
from specchat.engine.events import LoadProgress
from specchat.engine.model import quant
from specchat.engine.weights import stream
from specchat.engine.weights.gguf_file import GgufCheckpoint
from specchat.engine.weights.loading import load_model
from tests.ggufs import dequantize_q4_k, dequantize_q6_k, write_gguf

CPU = torch.device("cpu")
PROMPT = torch.tensor([[5, 9, 11, 40, 41, 42, 9, 11]])


def _shell(path: Path) -> tuple[torch.nn.Module, object]:
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, config


def test_the_reader_dequantizes_q4_k_and_q6_k_as_their_block_layouts_say(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    raw = write_gguf(path, arch="qwen2", seed=3)
    model, config = _shell(path)
    checkpoint = GgufCheckpoint(path, model, config)
    assert checkpoint.quant_types() == {"Q4_K": 13, "Q6_K": 3, "F32": 11}
    for gguf_name, hf_name, reference in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", dequantize_q4_k),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", dequantize_q6_k),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", dequantize_q6_k),
        ("output.weight", "lm_head.weight", dequantize_q6_k),
    ]:
        got = checkpoint.get(hf_name)
        kind, data = raw[gguf_name]
        want = reference(data, *got.shape)
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-9, err_msg=gguf_name)
        assert float(np.abs(want).max()) > 0  # not a block of zeros compared with zeros
    assert torch.equal(checkpoint.get("model.norm.weight"), torch.from_numpy(raw["output_norm.weight"][1]))
    with pytest.raises(KeyError, match="no tensor"):
        checkpoint.get("model.layers.9.mlp.up_proj.weight")


def test_llama_q_and_k_rows_come_back_in_the_model_order(tmp_path: Path) -> None:
    """llama.cpp's converter interleaves each head's rotary halves; reading undoes it."""
    path = tmp_path / "llama.gguf"
    raw = write_gguf(path, arch="llama", seed=4)
    model, config = _shell(path)
    checkpoint = GgufCheckpoint(path, model, config)

    def to_gguf_order(w: np.ndarray, heads: int) -> np.ndarray:  # convert_hf_to_gguf's permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    for gguf_name, hf_name, heads in [
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", 4),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", 2),
    ]:
        got = checkpoint.get(hf_name).numpy()
        stored = dequantize_q4_k(raw[gguf_name][1], *got.shape)
        assert not np.allclose(got, stored)  # the order did change
        np.testing.assert_allclose(to_gguf_order(got, heads), stored, rtol=1e-6, atol=1e-9)


def _runnable(mode: QuantMode, config: object) -> None:
    try:
        quant.check(mode, config, CPU)
    except QuantizationError as exc:
        pytest.skip(f"{mode} does not run here: {exc.message}")


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", True), ("qwen2", False), ("llama", False)])
@pytest.mark.parametrize("mode", [QuantMode.W4A8, QuantMode.INT8])
def test_a_gguf_loads_piece_by_piece_to_what_the_whole_load_gives(
    tmp_path: Path, arch: str, tied: bool, mode: QuantMode
) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch=arch, tied=tied, seed=5)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    _runnable(mode, whole.config)
    events: list[LoadProgress] = []
    got = load_model(ModelSpec(str(path), mode, dtype="float32", device="cpu"), "target", progress=events.append)
    assert any("layer by layer" in e.detail for e in events if e.stage == "quantize")
    assert got.info.params == sum(p.numel() for p in whole.parameters())
    assert got.eos_ids == {2}  # the GGUF's eos id, from its metadata
    want = quant.apply(whole, mode)
    with torch.no_grad():
        a, b = got.model(PROMPT).logits, want(PROMPT).logits
    assert torch.equal(a, b), float((a - b).abs().max())
    assert got.tokenizer.decode(got.tokenizer("def f(x):")["input_ids"]) == "def f(x):"


def test_a_gguf_streams_where_the_mode_is_post_load(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path)
    _, config = _shell(path)
    assert stream.unstreamable(str(tmp_path), path.name, config, QuantMode.W4A8, CPU) is None
    assert "no file" in str(stream.unstreamable(str(tmp_path), "gone.gguf", config, QuantMode.W4A8, CPU))
    assert "no quantization" in str(stream.unstreamable(str(tmp_path), path.name, config, QuantMode.NONE, CPU))


PEAK = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from specchat.engine.config import QuantMode
    from specchat.engine.weights.stream import load_streamed
    from transformers import AutoConfig

    def anon():  # anonymous resident memory: not the GGUF's mapped pages
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    path = Path(sys.argv[1])
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    print(json.dumps({"before": anon()}), flush=True)
    sys.stdin.readline()  # the parent watches from here on
    model, params = load_streamed(path.parent, config, QuantMode.INT8, torch.float32, gguf_file=path.name)
    print(json.dumps({"params": params}), flush=True)
    """
)


def _reply(stream: IO[str]) -> dict[str, int]:
    """The child's next JSON line (libraries may print their own lines first)."""
    for line in stream:
        if line.startswith("{"):
            return dict(json.loads(line))
    raise AssertionError("the child process ended without its figures")


def _peak_anon(pid: int, process: subprocess.Popen[str]) -> int:
    """The highest RssAnon of `pid` until it exits, read every 2 ms from outside it (a
    thread inside would take the interpreter's lock from the load it measures)."""
    peak = 0
    status = Path(f"/proc/{pid}/status")
    while process.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            break
        time.sleep(0.002)
    return peak


def test_peak_memory_stays_a_few_tensors_above_the_int8_model(tmp_path: Path) -> None:
    """Real widths (hidden 1536, intermediate 8960: the 1.5B's), four layers in Q4_K/Q6_K.
    The whole model in float32 is 0.77 GB; its largest tensor (a 1536 x 8960 matrix)
    55 MB. Loaded tensor by tensor, the peak of the process's anonymous memory grows
    by the int8 model plus at most a layer in float32 (3.4 largest tensors) and the
    one being dequantized with gguf's intermediates: 5.2 measured, 7 allowed (sampled
    every 2 ms from outside a fresh process, glibc's mmap threshold fixed as in
    test_stream)."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("needs Linux's /proc to sample the process's memory")
    hidden, inter, vocab, layers = 1536, 8960, 4096, 4
    path = tmp_path / "wide.gguf"
    write_gguf(path, hidden=hidden, intermediate=inter, layers=layers, heads=12, kv_heads=2, vocab=vocab,
               tied=True)  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    child = subprocess.Popen(
        [sys.executable, "-c", PEAK, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdin is not None and child.stdout is not None
    before = _reply(child.stdout)["before"]
    child.stdin.write("go\n")
    child.stdin.flush()
    peak = _peak_anon(child.pid, child)
    result = _reply(child.stdout)
    assert child.wait() == 0
    largest = hidden * inter * 4
    float_model = result["params"] * 4
    int8_model = float_model / 4 + vocab * hidden * 4  # a byte a weight, the embedding in float
    grew = peak - before
    print(f"peak grew {grew / 1e6:.0f} MB: int8 model {int8_model / 1e6:.0f} MB + "
          f"{(grew - int8_model) / largest:.1f} largest tensors; float model {float_model / 1e6:.0f} MB")  # fmt: skip
    assert grew < int8_model + 7 * largest, grew
    assert grew < 0.8 * float_model


def test_chunked_dequantization_equals_gguf_s_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's chunks (a few rows each here) give gguf.dequantize's array bit for bit."""
    from gguf import GGUFReader, dequantize

    from specchat.engine.weights import gguf_file

    path = tmp_path / "m.gguf"
    write_gguf(path, seed=8)
    monkeypatch.setattr(gguf_file, "CHUNK_VALUES", 3 * 256)  # three rows of 256 at a time
    kinds = set()
    for tensor in GGUFReader(str(path)).tensors:
        got = gguf_file._dequantized(tensor, dequantize)
        want = dequantize(tensor.data, tensor.tensor_type)
        assert got.shape == want.shape and np.array_equal(got, want), tensor.name
        kinds.add(tensor.tensor_type.name)
    assert kinds == {"Q4_K", "Q6_K", "F32"}
