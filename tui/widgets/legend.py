"""One line naming each provenance in its own style."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from specchat.engine.events import Provenance

from .tokens import LABELS, TOKEN_COMPONENTS, provenance_styles, token_css


class Legend(Widget):
    """`tokens: accepted · corrected · bonus · early exit · target`, each drawn as it appears in replies."""

    COMPONENT_CLASSES = TOKEN_COMPONENTS
    DEFAULT_CSS = token_css("Legend") + "\nLegend { height: 1; }"

    remote: reactive[bool] = reactive(False)  # a served engine: its tokens are all "remote"

    def render(self) -> Text:
        styles = provenance_styles(self)
        out = Text(end="")
        out.append("tokens: ", style="dim")
        shown = [Provenance.REMOTE] if self.remote else [p for p in Provenance if p is not Provenance.REMOTE]
        for i, prov in enumerate(shown):
            if i:
                out.append(" · ", style="dim")
            out.append(LABELS[prov], style=styles[prov])
        if self.remote:
            out.append(" (the server does not say which were drafted)", style="dim")
        out.append("   (F1 explains)", style="dim")
        return out
