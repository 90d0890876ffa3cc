"""Side panels: acceptance, latency, devices, early exit. Each redraws from the app's ChatState."""

from .acceptance import AcceptancePanel
from .base import Panel
from .devices import DevicesPanel
from .early_exit import EarlyExitPanel
from .latency import LatencyPanel

PANEL_TYPES: tuple[type[Panel], ...] = (AcceptancePanel, LatencyPanel, DevicesPanel, EarlyExitPanel)

__all__ = ["PANEL_TYPES", "AcceptancePanel", "DevicesPanel", "EarlyExitPanel", "LatencyPanel", "Panel"]
