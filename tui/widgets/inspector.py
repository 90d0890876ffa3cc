"""The token inspector: where the selected token came from and how sure each model was."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from specchat.engine.config import Mode
from specchat.engine.events import Provenance, RoundEvent, TokenEvent

from .tokens import DESCRIPTIONS, LABELS, TOKEN_COMPONENTS, provenance_styles, token_css, visible


def _p(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


class Inspector(Widget):
    """Shows one token of one reply; empty text when nothing is selected."""

    COMPONENT_CLASSES = TOKEN_COMPONENTS
    DEFAULT_CSS = token_css("Inspector")
    HELP = "←/→ token · ↑/↓ round · pgup/pgdn reply · v view · esc back"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.token: TokenEvent | None = None
        self.index: int | None = None
        self.count = 0
        self.round: RoundEvent | None = None
        self.border_title = "Token inspector"

    def show(
        self, token: TokenEvent | None, index: int | None, count: int, rnd: RoundEvent | None
    ) -> None:
        self.token, self.index, self.count, self.round = token, index, count, rnd
        self.refresh(layout=True)

    def render(self) -> Table | Text:
        tok = self.token
        if tok is None or self.index is None:
            return Text(f"No token selected.\n{self.HELP}", style="italic")
        style = provenance_styles(self)[tok.provenance]
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        grid.add_row("token", f"{self.index + 1} of {self.count}")
        piece = Text(visible(tok.text), style=style)
        piece.append(f"  id {tok.token_id}" if tok.token_id >= 0 else "  id n/a (server)", style="")
        grid.add_row("text", piece)
        label = Text(LABELS[tok.provenance].upper(), style=style)
        if tok.position is not None:
            label.append(f"  draft position {tok.position + 1}", style="")
        grid.add_row("source", label)
        grid.add_row("", Text(DESCRIPTIONS[tok.provenance], style="italic"))
        if tok.provenance is Provenance.REMOTE:
            grid.add_row("p (server)", _p(tok.p_target) if tok.p_target is not None else "n/a (none sent for this token)")
            for rank, (alt, p_alt) in enumerate(tok.alternatives, 1):
                grid.add_row("" if rank > 1 else "top", f"{visible(alt)}  {_p(p_alt)}")
            grid.add_row("round", f"{tok.round} (a chunk of the server's stream)")
            grid.add_row("", Text(self.HELP, style="italic"))
            return grid
        grid.add_row("p_target", _p(tok.p_target))
        p_draft = _p(tok.p_draft)
        copied = self.round is not None and (
            self.round.mode is Mode.LOOKUP or self.round.drafter == "lookup"
        )
        if copied and tok.position is not None:
            p_draft += "  (lookup: copied from earlier in the conversation)"
        grid.add_row("p_draft", p_draft)
        if self.round is not None and self.round.drafter and tok.position is not None:
            grid.add_row("drafted by", self.round.drafter)
        if tok.draft_rank is not None:
            guess = "its first guess, the chain's" if tok.draft_rank == 1 else (
                f"its guess no. {tok.draft_rank} at this depth, verified beside the chain's "
                "(the refused one below)"
            )
            grid.add_row("draft tree", guess)
        if tok.provenance is Provenance.CORRECTED or tok.rejected_id is not None:
            refused = "—"
            if tok.rejected_id is not None:
                refused = f"{visible(tok.rejected_text or '')}  id {tok.rejected_id}"
            grid.add_row("refused", refused)
        if tok.provenance is Provenance.EARLY_EXIT or tok.exit_layer is not None:
            layer = "—" if tok.exit_layer is None else str(tok.exit_layer)
            grid.add_row("exit layer", layer)
            grid.add_row("confidence", _p(tok.confidence))
        rnd = self.round
        grid.add_row("round", str(tok.round))
        if rnd is not None:
            desc = f"{rnd.mode.value}"
            if rnd.k:
                desc += f" · K {rnd.k} · accepted {rnd.accepted}"
            if rnd.siblings:
                more = "guess" if rnd.siblings == 1 else "guesses"
                desc += f" · a tree: {rnd.siblings} more {more} verified"
            grid.add_row("", desc)
            grid.add_row("", f"draft {rnd.draft_ms:.1f} ms · verify {rnd.verify_ms:.1f} ms")
            if rnd.fallback_reason:
                grid.add_row("fallback", rnd.fallback_reason)
        grid.add_row("", Text(self.HELP, style="italic"))
        return grid
