"""The chat's actions in one table: key, footer label, palette title and help.

The app's BINDINGS and its command palette entries are both made from
`ACTIONS`, so every action has a palette entry and the footer shows its key.
The value lists the F-keys cycle through are here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specchat.engine.config import Mode

MODE_CYCLE: tuple[Mode, ...] = (Mode.SPEC, Mode.EAGLE, Mode.SELF_SPEC, Mode.EARLY_EXIT, Mode.LOOKUP, Mode.PLAIN)
K_CYCLE: tuple[int | None, ...] = (None, 1, 2, 3, 4, 6, 8)
TEMPERATURE_CYCLE: tuple[float, ...] = (0.0, 0.3, 0.7, 1.0)
TOP_P_CYCLE: tuple[float, ...] = (1.0, 0.95, 0.9, 0.8)
BUDGET_CYCLE: tuple[float, ...] = (0.99, 0.95, 0.9, 0.8)
LIMIT_CYCLE: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)  # reply limits, in tokens
CONTINUE_KEY = "ctrl+o"  # named in the notice under a reply the limit cut
LIMIT_KEY = "ctrl+l"


def next_in(cycle: tuple, value: object) -> object:  # type: ignore[type-arg]
    """The value after `value` in `cycle` (the first one if `value` is not in it)."""
    try:
        return cycle[(cycle.index(value) + 1) % len(cycle)]
    except ValueError:
        return cycle[0]


def next_limit(limit: int) -> int:
    """The next larger reply limit of LIMIT_CYCLE (from the largest, the smallest)."""
    return next((n for n in LIMIT_CYCLE if n > limit), LIMIT_CYCLE[0])


@dataclass(frozen=True)
class Setting:
    """A decode setting the keys and the palette change: `set_decode(name, value)` sets it,
    `cycle(name)` moves it to the next value of `values`."""

    name: str  # the action's argument
    field: str  # the DecodeConfig field it sets
    label: str  # "K", "Temperature", ... as the notice names it
    values: tuple[Any, ...]  # what the key cycles through; the palette offers each
    key: str  # the cycling key
    footer: str  # footer label
    title: str  # palette title of the cycling action
    help: str  # palette help of the cycling action
    describe: Callable[[Any], str]  # palette title of one value
    explain: Callable[[Any], str]  # palette help of one value
    show: bool = True  # the cycling key in the footer
    to_config: Callable[[Any], Any] = lambda v: v  # the action argument -> the field's value
    to_action: Callable[[Any], Any] = lambda v: v  # the field's value -> the action argument
    shown: Callable[[Any], str] = str  # the field's value in the notice
    after: str = ""  # said after the value in the notice
    step: Callable[[tuple[Any, ...], Any], Any] = next_in  # the next value of the cycle


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("mode", "mode", "Mode", MODE_CYCLE, "f7", "Mode", "Next decoding mode",
                "spec → eagle (with a draft head) → self-spec → early-exit → lookup → plain",
                lambda m: f"Mode: {m.value}", lambda m: f"Decode the next replies in {m.value} mode",
                to_config=Mode, to_action=lambda m: m.value, shown=lambda m: m.value,
                after=" (from the next reply)"),
        Setting("k", "k", "K", K_CYCLE, "f8", "K", "Next K",
                "Draft tokens per round: auto, 1, 2, 3, 4, 6, 8",
                lambda k: f"K: {'auto' if k is None else k}",
                lambda k: "Let the controller choose K" if k is None else f"Draft {k} tokens per round",
                to_config=lambda k: int(k) or None, to_action=lambda k: k or 0,
                shown=lambda k: "auto" if k is None else str(k)),
        Setting("temperature", "temperature", "Temperature", TEMPERATURE_CYCLE, "f9", "Temp",
                "Next temperature", "0 (greedy), 0.3, 0.7, 1.0",
                lambda t: f"Temperature: {t:g}",
                lambda t: "Greedy decoding" if t == 0 else f"Sample at temperature {t:g}",
                to_config=float, shown=lambda t: f"{t:g}"),
        Setting("top_p", "top_p", "Top-p", TOP_P_CYCLE, "shift+f9", "top-p", "Next top-p",
                "1.0 (off), 0.95, 0.9, 0.8", lambda p: f"Top-p: {p:g}",
                lambda p: "Nucleus sampling off" if p == 1 else f"Keep the top {p:g} of the mass",
                show=False, to_config=float, shown=lambda p: f"{p:g}"),
        Setting("budget", "exit_budget", "Early-exit budget", BUDGET_CYCLE, "shift+f5", "Budget",
                "Next early-exit budget", "Top-1 agreement kept by early exit: 0.99, 0.95, 0.9, 0.8",
                lambda b: f"Early-exit budget: {b:g}",
                lambda b: f"Keep {b:.0%} top-1 agreement with the full target",
                show=False, to_config=float, shown=lambda b: f"{b:g}"),
        Setting("limit", "max_new_tokens", "Reply limit", LIMIT_CYCLE, LIMIT_KEY, "Limit",
                "Next reply limit", "Most tokens in one reply: 256, 512, 1024, 2048, 4096, 8192",
                lambda n: f"Reply limit: {n} tokens",
                lambda n: f"Stop a reply after {n} tokens; {CONTINUE_KEY} continues a cut reply",
                show=False, to_config=int, shown=lambda n: f"{n} tokens",
                step=lambda _cycle, n: next_limit(n)),
    )
}


@dataclass(frozen=True)
class Action:
    key: str  # "" for palette-only actions
    action: str  # Textual action string, run on the app
    label: str  # footer label
    title: str  # palette title
    help: str  # palette help line
    show: bool = True  # in the footer


def _cycling(name: str) -> Action:
    s = SETTINGS[name]
    return Action(s.key, f"cycle({name!r})", s.footer, s.title, s.help, show=s.show)


ACTIONS: tuple[Action, ...] = (
    Action("escape", "stop", "Stop", "Stop the reply", "Cancel the reply in flight; the session stays usable"),
    Action("ctrl+n", "new_chat", "New chat", "New conversation", "Forget the conversation and the statistics"),
    Action(CONTINUE_KEY, "continue_reply", "Continue", "Continue the cut reply",
           "Decode more of the last reply, which the reply limit cut; esc stops it"),
    Action("ctrl+r", "ab", "A/B", "A/B against plain decoding",
           "Regenerate the last reply with plain decoding (same seed and temperature) and show where they differ"),
    Action("ctrl+t", "toggle_view", "Markdown/tokens", "Toggle Markdown / tokens view",
           "Show finished replies as rendered Markdown or as tokens styled by provenance"),
    Action("f6", "inspect", "Inspect", "Inspect tokens",
           "Move through the tokens of a reply and see where each came from"),
    Action("f2", "toggle_panel('acceptance')", "Accept", "Toggle the acceptance panel",
           "Acceptance rate, by draft position, accepted lengths, controller K and fallbacks"),
    Action("f3", "toggle_panel('latency')", "Latency", "Toggle the latency panel",
           "Per-token latency, p50/p95, time to first token, draft vs verify time, expected speedup"),
    Action("f4", "toggle_panel('devices')", "Devices", "Toggle the devices panel",
           "CPU per core, process CPU and memory, GPU, where each model runs, weight and KV bytes"),
    Action("f5", "toggle_panel('early-exit')", "Exit", "Toggle the early-exit panel",
           "Exit rate, exit layers, layers run per token, budget against realised agreement"),
    *(_cycling(name) for name in ("mode", "k", "temperature", "top_p", "budget", "limit")),
    Action("ctrl+g", "plain_toggle", "Plain", "Roll back to plain decoding",
           "Switch to plain decoding now; again to return to the previous mode"),
    Action("f1", "help", "Help", "Help", "Keys, provenance styles, long replies, A/B and settings file"),
)

PALETTE_ONLY: tuple[Action, ...] = (
    *(Action("", f"set_decode({s.name!r}, {s.to_action(v)!r})", "", s.describe(v), s.explain(v))
      for s in SETTINGS.values() for v in s.values),
    Action("", "settings_path", "", "Settings file", "Show where settings are saved"),
)
