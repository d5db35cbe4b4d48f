"""How sizes, durations and fractions read on the dashboard and on the logbook's pages."""

from typing import Optional


def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "–"
    for unit, size, digits in (("GiB", 1024**3, 2), ("MiB", 1024**2, 1), ("KiB", 1024, 0)):
        if n >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"


def fmt_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def fmt_pct(x: Optional[float]) -> str:
    """A fraction as a percentage: 0.9125 -> 91.25%."""
    return "–" if x is None else f"{100 * x:.2f}%"


def fmt_percent(x: Optional[float]) -> str:
    """A value already in percent: 47.3 -> 47%."""
    return "–" if x is None else f"{x:.0f}%"
