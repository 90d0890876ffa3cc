"""F1: keys, provenance styles, long replies, what A/B does, where settings live."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from specchat.engine.events import Provenance

from ..actions import ACTIONS, CONTINUE_KEY, LIMIT_CYCLE, LIMIT_KEY
from .tokens import DESCRIPTIONS, LABELS, TEXT_STYLES


def help_markdown(settings_path: str) -> str:
    keys = "\n".join(f"| `{a.key}` | {a.title} | {a.help} |" for a in ACTIONS if a.key)
    legend = "\n".join(
        f"| {LABELS[p]} | {TEXT_STYLES[p] if TEXT_STYLES[p] != 'none' else 'plain'} | {DESCRIPTIONS[p]} |"
        for p in Provenance
    )
    return f"""\
# specchat

Type a prompt and press **enter**. A paste keeps all its lines: the prompt
shows each line break as ↵ and sends it as one. **↑ / ↓** in the prompt browse
what you sent before (failed and stopped prompts too). Every action is also in
the command palette (**ctrl+p**).

| key | action | |
|---|---|---|
{keys}

## Tokens

While a reply streams, and in the tokens view, each token shows where it
came from, by colour (the theme's) and by text style (without colour too):

| provenance | style | meaning |
|---|---|---|
{legend}

## Inspecting tokens

**F6** (or a click on a token) moves into the transcript: **←/→** token,
**↑/↓** round, **home/end** first/last token, **pgup/pgdn** previous/next
reply, **v** Markdown/tokens for that reply, **esc** back to the prompt.
The inspector shows p_target, p_draft, the refused draft token of a
correction, the exit layer and confidence of an early exit, and the round.

## Long replies

A reply runs until the model ends it, or until the **reply limit** (shown as
`limit` in the top line; **{LIMIT_KEY}** or the palette sets it to
{", ".join(str(n) for n in LIMIT_CYCLE)}, the settings file or
`--max-new-tokens` to any number). A reply the limit cut says so under its
text; **{CONTINUE_KEY}** continues the last one in place, up to the limit
again, and **esc** stops the continuation like any reply. A reply also ends
when the context window is full.

## A/B

**ctrl+r** answers the last prompt again with plain decoding (mode plain,
same seed, temperature and top-p), shown as reply **B** under the original
**A**, with the first token where they differ and both speeds. Lossless
modes (spec, eagle, lookup, self-spec) should match exactly at temperature 0; early exit
may not, and its panel then shows the realised agreement. The engine keeps
reply B as the answer in the conversation: the next turn continues from it.

## The draft head

**F7** reaches `eagle` when a draft head is loaded: one decoder layer fed the
target's own hidden states drafts (a few % of a target step). Train one for
the target with `specchat train-draft --minutes N`; the chat finds it in the
cache, or takes `--draft-head FOLDER` (a speculators EAGLE-3 checkpoint, as
vLLM serves). The inspector names the drafter of each round.

## Settings

Mode, K, temperature, top-p, budget, reply limit, panels, view and theme are saved to
`{settings_path}` (or `$SPECCHAT_CONFIG`); command-line flags override them.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; height: 90%; border: round $primary; background: $surface; padding: 0 1; }
    """

    def __init__(self, settings_path: str) -> None:
        super().__init__()
        self.settings_path = settings_path

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(help_markdown(self.settings_path))
