"""Early exit: how often the target stops early, at which layer, and what it costs in agreement."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from specchat.engine.config import Mode

from .base import Panel, histogram, key_values, pct


class EarlyExitPanel(Panel):
    TITLE = "Early exit"
    KEY = "early-exit"

    def render(self) -> Group:
        st = self.state
        m = st.metrics
        layers = st.ready.target.layers if st.ready else 0
        mean_layers = m.mean_layers(layers) if layers else None
        rate = m.exit_rate
        conf = m.mean_exit_confidence
        rows: list[tuple[str, str | Text]] = [
            ("exit rate", "n/a" if rate is None else f"{pct(rate, 1)} ({m.exit_tokens} tokens)"),
            ("layers run", "n/a" if mean_layers is None else f"{mean_layers:.1f} of {layers} on average"),
            ("confidence", "n/a" if conf is None else f"{conf:.3f} mean at exit"),
            ("budget", f"{pct(st.decode.exit_budget)} top-1 agreement"),
        ]
        ab = st.ab
        if ab is None or ab.a_mode is not Mode.EARLY_EXIT:
            rows.append(("realised", "n/a: run A/B (ctrl+r) on an early-exit reply"))
        else:
            rows.append(
                (
                    "realised",
                    f"{pct(ab.agreement)}: {ab.diverge_at if ab.diverge_at is not None else ab.b_tokens}"
                    f" of {ab.b_tokens} plain tokens before divergence",
                )
            )
        parts: list[object] = [key_values(rows)]
        hist = m.exit_layer_histogram()
        if hist:
            parts.append(Text("exit layer", style="bold"))
            parts.append(histogram([(f"L{layer}", n) for layer, n in hist.items()]))
        return Group(*parts)  # type: ignore[arg-type]
