"""specchat's Textual themes and the provenance colours.

Every colour of the app lives here. Widgets and TCSS name theme variables
(`$token-accepted`, ...); the themes below set them, and
`PROVENANCE_DEFAULTS` fills them in for Textual's built-in themes through
`App.get_theme_variable_defaults()`.

Colour is never the only carrier of provenance: each is paired with a text
style (`TEXT_STYLES`), so the transcript stays readable with NO_COLOR. The app's
TCSS and the headless `specchat generate` (`terminal_styles`) both take their
provenance looks from here.
"""

from __future__ import annotations

from textual.theme import Theme

# Theme variable names, one per provenance (engine Provenance values).
TOKEN_VARIABLES: dict[str, str] = {
    "accepted": "token-accepted",
    "corrected": "token-corrected",
    "bonus": "token-bonus",
    "early-exit": "token-early-exit",
    "target": "token-target",
    "remote": "token-remote",
}

# The text style paired with each provenance's colour (Textual text-style names,
# which rich reads too): readable without colour.
TEXT_STYLES: dict[str, str] = {
    "accepted": "underline",
    "corrected": "bold underline",
    "bonus": "bold",
    "early-exit": "italic",
    "target": "none",
    "remote": "none",  # a served reply is remote throughout: nothing to tell apart
}

# Okabe & Ito (2008) colour-universal-design palette.
OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky-blue": "#56B4E9",
    "bluish-green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish-purple": "#CC79A7",
}

# Mid-luminance colours that read on dark and light backgrounds alike:
# the fallback for themes that do not set the token variables.
PROVENANCE_DEFAULTS: dict[str, str] = {
    "token-accepted": "#4FA3D9",
    "token-corrected": "#E0603A",
    "token-bonus": "#C99A1A",
    "token-early-exit": "#B877C4",
    "token-target": "#8C9AA6",
    "token-remote": "#5FB08A",
}

SPECCHAT_DARK = Theme(
    name="specchat-dark",
    primary="#5FA8D3",
    secondary="#3D6B8C",
    accent="#F2B134",
    warning="#F2B134",
    error="#E4572E",
    success="#6CC46C",
    foreground="#DDE3E8",
    background="#14181C",
    surface="#1C2228",
    panel="#242C34",
    dark=True,
    variables={
        "token-accepted": "#6CC3F0",
        "token-corrected": "#FF7A59",
        "token-bonus": "#F2C14E",
        "token-early-exit": "#C792EA",
        "token-target": "#B8C4CE",
        "token-remote": "#8FD6B4",
        "footer-key-foreground": "#5FA8D3",
    },
)

SPECCHAT_LIGHT = Theme(
    name="specchat-light",
    primary="#1F5F8B",
    secondary="#4B86B4",
    accent="#B5651D",
    warning="#B5651D",
    error="#B3261E",
    success="#2E7D32",
    foreground="#1E252B",
    background="#F7F7F4",
    surface="#EDEDE8",
    panel="#E1E3DE",
    dark=False,
    variables={
        "token-accepted": "#1565A8",
        "token-corrected": "#C0392B",
        "token-bonus": "#8A6100",
        "token-early-exit": "#7B3FA0",
        "token-target": "#3A444C",
        "token-remote": "#2E6B50",
        "footer-key-foreground": "#1F5F8B",
    },
)

# Colour-blind safe: the provenance colours come from the Okabe-Ito palette,
# leaving out orange, which deuteranopes confuse with vermillion (corrected).
SPECCHAT_OKABE_ITO = Theme(
    name="specchat-okabe-ito",
    primary=OKABE_ITO["sky-blue"],
    secondary=OKABE_ITO["blue"],
    accent=OKABE_ITO["yellow"],
    warning=OKABE_ITO["orange"],
    error=OKABE_ITO["vermillion"],
    success=OKABE_ITO["bluish-green"],
    foreground="#F0F0F0",
    background="#101010",
    surface="#1A1A1A",
    panel="#262626",
    dark=True,
    variables={
        "token-accepted": OKABE_ITO["sky-blue"],
        "token-corrected": OKABE_ITO["vermillion"],
        "token-bonus": OKABE_ITO["yellow"],
        "token-early-exit": OKABE_ITO["reddish-purple"],
        "token-target": "#F0F0F0",
        "token-remote": OKABE_ITO["bluish-green"],
        "footer-key-foreground": OKABE_ITO["sky-blue"],
    },
)

THEMES: tuple[Theme, ...] = (SPECCHAT_DARK, SPECCHAT_LIGHT, SPECCHAT_OKABE_ITO)
DEFAULT_THEME = SPECCHAT_DARK.name


def terminal_styles(theme: Theme = SPECCHAT_DARK, colour: bool = True) -> dict[str, str]:
    """Rich style strings by provenance value: the theme's colour plus the text style,
    or the text style alone (no colour) for a monochrome terminal."""
    out = {}
    for provenance, variable in TOKEN_VARIABLES.items():
        style = TEXT_STYLES[provenance].replace("none", "")
        hue = (theme.variables or {}).get(variable) or PROVENANCE_DEFAULTS[variable]
        out[provenance] = f"{hue} {style}".strip() if colour else style
    return out

__all__ = [
    "DEFAULT_THEME",
    "OKABE_ITO",
    "PROVENANCE_DEFAULTS",
    "SPECCHAT_DARK",
    "SPECCHAT_LIGHT",
    "SPECCHAT_OKABE_ITO",
    "TEXT_STYLES",
    "THEMES",
    "TOKEN_VARIABLES",
    "terminal_styles",
]
