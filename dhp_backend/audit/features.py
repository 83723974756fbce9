"""The attention features of an audited layer (issue 31): the ``--features`` option of G1 and G4.

A layer's sliding window, logits soft-cap and attention sinks are public model
configuration (design.md section 2): each selects the binary a layer runs, never
a trip count or an address that follows a secret (docs/kernels.md section 6).
`classes.Shape` carries them (``sliding_window``, ``logits_soft_cap``, ``sinks``);
this module declares the option both gates share, parses it, and names the
features in report rows (`Features.label`) and in shape keys (`Features.key`).

Syntax of ``--features``: comma-separated items, each at most once, in any order:
``window=W`` (an int >= 1: the row at position q sees keys q - W < p <= q),
``softcap=C`` (a finite number > 0: scores become C tanh(s / C)), ``sinks`` (a
per-head sink logit; the audit's is seeded, the same for every class: a model
weight). ``""`` or ``none``: plain attention. Example: ``window=4096,softcap=50,sinks``.

Torch-free, so that declaring the option costs the command line nothing.
"""

from __future__ import annotations

import dataclasses
import math

ACCEPTED = ("comma-separated items, each at most once: window=W (an int >= 1), softcap=C (a finite number > 0), "
            "sinks; or 'none' / '' for plain attention (e.g. window=4096,softcap=50,sinks)")


def _number(x: float) -> str:
    """A cap as text that reads back to the same float, without an exponent or a '-' (shape keys split on
    '-'): 50.0 -> '50', 30.5 -> '30.5', 1e-05 -> '0.00001'."""
    import numpy as np

    return np.format_float_positional(float(x), trim="-")


@dataclasses.dataclass(frozen=True)
class Features:
    """A layer's public attention features; the zero values mean none (the seam's ``None``)."""

    sliding_window: int = 0
    logits_soft_cap: float = 0.0
    sinks: bool = False

    def __post_init__(self):
        w, c = self.sliding_window, self.logits_soft_cap
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"sliding_window is {w!r}; accepted: 0 (no window) or an int W >= 1")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"logits_soft_cap is {c!r}; accepted: 0 (no cap) or a finite number > 0")
        if not isinstance(self.sinks, bool):
            raise ValueError(f"sinks is {self.sinks!r}; accepted: True or False")

    def __bool__(self) -> bool:
        return bool(self.sliding_window or self.logits_soft_cap or self.sinks)

    @property
    def label(self) -> str:
        """The features as ``--features`` spells them (canonical order), "" for none: a report row's
        ``features``."""
        return ",".join(([f"window={self.sliding_window}"] if self.sliding_window else [])
                        + ([f"softcap={_number(self.logits_soft_cap)}"] if self.logits_soft_cap else [])
                        + (["sinks"] if self.sinks else []))

    @property
    def key(self) -> str:
        """The suffix of `classes.Shape.key` (``-win4096-softcap50-sinks``), "" for none, so plain shapes
        keep their keys (report rows and merges of earlier runs)."""
        return "".join(([f"-win{self.sliding_window}"] if self.sliding_window else [])
                       + ([f"-softcap{_number(self.logits_soft_cap)}"] if self.logits_soft_cap else [])
                       + (["-sinks"] if self.sinks else []))

    def shape_fields(self) -> dict:
        """Keyword arguments of `classes.Shape`."""
        return dataclasses.asdict(self)


def of(shape) -> Features:
    """The features of a `classes.Shape` (or anything with the three fields)."""
    return Features(shape.sliding_window, shape.logits_soft_cap, shape.sinks)


def parse(text: str | None) -> Features:
    """``--features`` text to `Features`; ValueError naming the bad item and what is accepted."""
    text = "" if text is None else str(text)
    if text.strip().lower() in ("", "none"):
        return Features()
    seen: dict = {}
    for item in text.split(","):
        item = item.strip()
        name, eq, value = item.partition("=")
        name, value = name.strip().lower(), value.strip()
        if not item:
            raise ValueError(f"--features: an empty item in {text!r}; accepted: {ACCEPTED}")
        if name in seen:
            raise ValueError(f"--features: {name!r} given twice in {text!r}; accepted: {ACCEPTED}")
        if name == "sinks":
            if eq:
                raise ValueError(f"--features: {item!r} (sinks takes no value); accepted: {ACCEPTED}")
            seen[name] = True
        elif name == "window":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--features: {item!r} (a window is an int >= 1); accepted: {ACCEPTED}")
            seen[name] = int(value)
        elif name == "softcap":
            try:
                cap = float(value)
            except ValueError:
                cap = math.nan
            if not math.isfinite(cap) or cap <= 0:
                raise ValueError(f"--features: {item!r} (a cap is a finite number > 0); accepted: {ACCEPTED}")
            seen[name] = cap
        else:
            raise ValueError(f"--features: unknown item {item!r}; accepted: {ACCEPTED}")
    return Features(sliding_window=seen.get("window", 0), logits_soft_cap=seen.get("softcap", 0.0),
                    sinks=seen.get("sinks", False))


def add_argument(parser) -> None:
    """The ``--features`` option, as G1 (`counters`) and G4 (`timing`) both declare it."""
    parser.add_argument("--features", default="",
                        help="attention features of every audited layer: window=W, softcap=C, sinks, "
                             "comma-separated (e.g. window=4096,softcap=50,sinks; default none: plain attention). "
                             "Such layers run the csrc kernels' feature libraries at heads 64, 80, 96 and 128, "
                             "the Triton kernels at other head sizes")
