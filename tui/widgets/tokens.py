"""How provenance looks: one colour (a theme variable) plus one text style each.

The text style keeps provenance readable without colour (NO_COLOR, or a
monochrome terminal):

    accepted    underline         corrected   bold underline
    bonus       bold              early-exit  italic
    target      plain             cursor      reverse
    remote      plain (a served reply has no other provenance)

Widgets that draw tokens list `TOKEN_COMPONENTS` as component classes, add
`token_css(<their name>)` to their DEFAULT_CSS and call `provenance_styles()`.
"""

from __future__ import annotations

from rich.style import Style
from textual.widget import Widget

from specchat import themes
from specchat.engine.events import Provenance

TEXT_STYLES: dict[Provenance, str] = {p: themes.TEXT_STYLES[p.value] for p in Provenance}

LABELS: dict[Provenance, str] = {
    Provenance.ACCEPTED: "accepted",
    Provenance.CORRECTED: "corrected",
    Provenance.BONUS: "bonus",
    Provenance.EARLY_EXIT: "early exit",
    Provenance.TARGET: "target",
    Provenance.REMOTE: "remote",
}

DESCRIPTIONS: dict[Provenance, str] = {
    Provenance.ACCEPTED: "a draft token the target accepted",
    Provenance.CORRECTED: "the target's token after it refused a draft token",
    Provenance.BONUS: "the target's extra token when all K drafts were accepted",
    Provenance.EARLY_EXIT: "the target stopped at an intermediate layer",
    Provenance.TARGET: "plain target decoding",
    Provenance.REMOTE: "the server does not say which were drafted",
}

TOKEN_COMPONENTS: set[str] = {f"token--{p.value}" for p in Provenance} | {"token--cursor"}


def token_css(widget: str) -> str:
    """Component-class rules for `widget`: colours from theme variables, paired with text styles."""
    rules = [
        f"{widget} > .token--{p.value} {{ color: $token-{p.value}; text-style: {TEXT_STYLES[p]}; }}"
        for p in Provenance
    ]
    rules.append(f"{widget} > .token--cursor {{ text-style: reverse bold; }}")
    return "\n".join(rules)


def provenance_styles(widget: Widget) -> dict[Provenance, Style]:
    """Rich styles for each provenance, resolved from the widget's CSS (and so the theme)."""
    return {p: widget.get_component_rich_style(f"token--{p.value}", partial=True) for p in Provenance}


def cursor_style(widget: Widget) -> Style:
    return widget.get_component_rich_style("token--cursor", partial=True)


def visible(text: str) -> str:
    """A token's text made visible on its own (inspector, cursor)."""
    if text == "":
        return "∅"
    return text.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "␣")
