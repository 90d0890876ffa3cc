"""One line naming each provenance in its own style."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from specchat.engine.events import Provenance

from .tokens import LABELS, TOKEN_COMPONENTS, provenance_styles, token_css


class Legend(Widget):
    """`tokens: accepted · corrected · bonus · early exit · target`, each drawn as it appears in replies."""

    COMPONENT_CLASSES = TOKEN_COMPONENTS
    DEFAULT_CSS = token_css("Legend") + "\nLegend { height: 1; }"

    def render(self) -> Text:
        styles = provenance_styles(self)
        out = Text(end="")
        out.append("tokens: ", style="dim")
        for i, prov in enumerate(Provenance):
            if i:
                out.append(" · ", style="dim")
            out.append(LABELS[prov], style=styles[prov])
        out.append("   (F1 explains)", style="dim")
        return out
