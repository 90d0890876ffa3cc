"""The chat's actions in one table: key, footer label, palette title and help.

The app's BINDINGS and its command palette entries are both made from
`ACTIONS`, so every action has a palette entry and the footer shows its key.
The value lists the F-keys cycle through are here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from specchat.engine.config import Mode

MODE_CYCLE: tuple[Mode, ...] = (Mode.SPEC, Mode.SELF_SPEC, Mode.EARLY_EXIT, Mode.LOOKUP, Mode.PLAIN)
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
class Action:
    key: str  # "" for palette-only actions
    action: str  # Textual action string, run on the app
    label: str  # footer label
    title: str  # palette title
    help: str  # palette help line
    show: bool = True  # in the footer


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
    Action("f7", "cycle_mode", "Mode", "Next decoding mode", "spec → self-spec → early-exit → lookup → plain"),
    Action("f8", "cycle_k", "K", "Next K", "Draft tokens per round: auto, 1, 2, 3, 4, 6, 8"),
    Action("f9", "cycle_temperature", "Temp", "Next temperature", "0 (greedy), 0.3, 0.7, 1.0"),
    Action("shift+f9", "cycle_top_p", "top-p", "Next top-p", "1.0 (off), 0.95, 0.9, 0.8", show=False),
    Action("shift+f5", "cycle_budget", "Budget", "Next early-exit budget",
           "Top-1 agreement kept by early exit: 0.99, 0.95, 0.9, 0.8", show=False),
    Action(LIMIT_KEY, "cycle_limit", "Limit", "Next reply limit",
           "Most tokens in one reply: 256, 512, 1024, 2048, 4096, 8192", show=False),
    Action("ctrl+g", "plain_toggle", "Plain", "Roll back to plain decoding",
           "Switch to plain decoding now; again to return to the previous mode"),
    Action("f1", "help", "Help", "Help", "Keys, provenance styles, long replies, A/B and settings file"),
)

PALETTE_ONLY: tuple[Action, ...] = (
    *(Action("", f"set_mode('{m.value}')", "", f"Mode: {m.value}", f"Decode the next replies in {m.value} mode")
      for m in MODE_CYCLE),
    *(Action("", f"set_k({k if k is not None else 0})", "", f"K: {'auto' if k is None else k}",
             "Let the controller choose K" if k is None else f"Draft {k} tokens per round")
      for k in K_CYCLE),
    *(Action("", f"set_temperature({t})", "", f"Temperature: {t:g}",
             "Greedy decoding" if t == 0 else f"Sample at temperature {t:g}")
      for t in TEMPERATURE_CYCLE),
    *(Action("", f"set_top_p({p})", "", f"Top-p: {p:g}", "Nucleus sampling off" if p == 1 else f"Keep the top {p:g} of the mass")
      for p in TOP_P_CYCLE),
    *(Action("", f"set_budget({b})", "", f"Early-exit budget: {b:g}", f"Keep {b:.0%} top-1 agreement with the full target")
      for b in BUDGET_CYCLE),
    *(Action("", f"set_limit({n})", "", f"Reply limit: {n} tokens",
             f"Stop a reply after {n} tokens; {CONTINUE_KEY} continues a cut reply")
      for n in LIMIT_CYCLE),
    Action("", "settings_path", "", "Settings file", "Show where settings are saved"),
)
