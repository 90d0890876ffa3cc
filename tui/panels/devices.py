"""Devices: CPU per core and for this process, GPU when there is one, and where each model runs."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from specchat.engine.events import ModelInfo

from .base import Panel, bar, key_values, nbytes, pct


def _model_line(info: ModelInfo | None) -> str:
    if info is None:
        return "none"
    return f"{info.device} · {info.dtype} · {info.quant} · {nbytes(info.weight_bytes)}"


class DevicesPanel(Panel):
    TITLE = "Devices"
    KEY = "devices"

    def render(self) -> Group:
        st = self.state
        s = st.sample
        parts: list[object] = []
        if s is None:
            parts.append(Text("sampling…", style="italic"))
        else:
            cores = Text()
            for i, v in enumerate(s.cpu_percent_per_core):
                cores.append(f"cpu{i:<2} {bar(v / 100, 12)} {v:5.1f}%\n")
            cores.rstrip()
            parts.append(cores)
            gpu = "n/a"
            if st.ready is not None and st.ready.server:
                gpu = "n/a (remote: its metrics carry no GPU figures)"
            elif s.gpu_mem_total_bytes is not None:
                util = "n/a" if s.gpu_util_percent is None else f"{s.gpu_util_percent:.0f}%"
                gpu = (
                    f"{s.gpu_name or 'GPU'} · util {util} · "
                    f"{nbytes(s.gpu_mem_used_bytes)} / {nbytes(s.gpu_mem_total_bytes)}"
                )
            parts.append(
                key_values(
                    [
                        ("process", f"{s.process_cpu_percent:.0f}% CPU · RSS {nbytes(s.rss_bytes)}"),
                        ("GPU", gpu),
                    ]
                )
            )
        ready = st.ready
        target = ready.target if ready else None
        draft = ready.draft if ready else None
        if ready is not None and ready.server:
            parts.append(self._server_rows(ready.server))
            return Group(*parts)  # type: ignore[arg-type]
        rows: list[tuple[str, str | Text]] = [
            ("target", _model_line(target)),
            ("draft", _model_line(draft)),
        ]
        share = st.metrics.draft_share
        if share is None:
            rows.append(("time", "n/a"))
        else:
            rows.append(("time", f"draft {pct(share)} · target {pct(1 - share)}"))
            rows.append(("", bar(share, 20)))
        kv = 0
        per_token = 0
        for info in (target, draft):
            if info is not None:
                per_token += info.kv_bytes_per_token
        kv = per_token * st.context_tokens
        rows.append(("KV cache", f"{nbytes(kv)} ({st.context_tokens} tokens × {nbytes(per_token)})"))
        weights = sum(i.weight_bytes for i in (target, draft) if i is not None)
        rows.append(("weights", nbytes(weights)))
        parts.append(key_values(rows))
        return Group(*parts)  # type: ignore[arg-type]

    def _server_rows(self, server: str) -> object:
        """Where a served engine runs, and the KV-cache share its metrics report."""
        m = self.state.metrics.server
        kv = "n/a (not in its metrics)"
        if m is not None and m.kv_cache_usage is not None:
            kv = f"{pct(m.kv_cache_usage, 1)} of the server's cache {bar(m.kv_cache_usage, 12)}"
        running = "n/a" if m is None or m.running is None else str(m.running)
        rows: list[tuple[str, str | Text]] = [
            ("target", f"remote: {server}"),
            ("KV cache", kv),
            ("requests", f"{running} running at the last sample"),
            ("this CPU", "the chat client only"),
        ]
        return key_values(rows)
