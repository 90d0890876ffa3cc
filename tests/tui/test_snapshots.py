"""A few deterministic screenshots: each panel, each specchat theme, the inspector.

Replays run as fast as possible with recorded timestamps, the devices panel
gets a fixed SystemSample, and the cursor does not blink, so the pictures do
not depend on the machine. Update them with `pytest --snapshot-update`.
"""

from __future__ import annotations

from typing import Any

from textual.pilot import Pilot
from tui_helpers import FIXED_SAMPLE, SIZE, make_app, ready, send

from specchat.engine.config import DecodeConfig
from specchat.engine.events import Provenance
from specchat.tui.messages import SystemSampled
from specchat.tui.widgets.reply import ReplyView
from specchat.tui.widgets.transcript import Transcript


async def _settle(pilot: Pilot) -> None:
    app: Any = pilot.app
    app._refresh_panels()
    app.clear_notifications()
    await pilot.pause()


async def _spec_reply_in_tokens_view(pilot: Pilot) -> None:
    await ready(pilot)
    await send(pilot, "What is speculative decoding?")
    await pilot.press("ctrl+t")
    await _settle(pilot)


def test_chat_tokens_and_default_panels(snap_compare: Any) -> None:
    """Dark theme, a speculative reply in the provenance view, acceptance and latency panels."""
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_spec_reply_in_tokens_view)


def test_inspector_on_a_corrected_token(snap_compare: Any) -> None:
    async def run_before(pilot: Pilot) -> None:
        await _spec_reply_in_tokens_view(pilot)
        app: Any = pilot.app
        reply = app.query_one(ReplyView)
        await pilot.press("f6")
        i = next(i for i, t in enumerate(reply.tokens) if t.provenance is Provenance.CORRECTED)
        app.query_one(Transcript).select(reply, i)
        await _settle(pilot)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


def test_devices_and_early_exit_panels(snap_compare: Any) -> None:
    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await pilot.press("f2", "f3", "f4", "f5", "f7", "f7")  # panels swapped, early-exit mode
        await send(pilot, "Tell me about early exit")
        pilot.app.post_message(SystemSampled(FIXED_SAMPLE))
        await pilot.pause()
        await _settle(pilot)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


def test_light_theme(snap_compare: Any) -> None:
    assert snap_compare(
        make_app(theme="specchat-light"),
        terminal_size=(120, 36),
        run_before=_spec_reply_in_tokens_view,
    )


def test_okabe_ito_theme(snap_compare: Any) -> None:
    assert snap_compare(
        make_app(theme="specchat-okabe-ito"),
        terminal_size=(120, 36),
        run_before=_spec_reply_in_tokens_view,
    )


def test_a_cut_reply_says_so_and_offers_to_continue(snap_compare: Any) -> None:
    """The notice under a reply the limit cut, the limit in the top line, ctrl+o in the footer."""

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await send(pilot, "What is speculative decoding?")
        await _settle(pilot)

    app = make_app(decode=DecodeConfig(max_new_tokens=24))
    assert snap_compare(app, terminal_size=(120, 30), run_before=run_before)
