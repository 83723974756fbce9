"""The attention features of an audited layer (issue 31): the ``--features`` option of G1 and G4.

A layer's sliding window, logits soft-cap and attention sinks are public model
configuration (design.md section 2): each selects the binary a layer runs, never
a trip count or an address that follows a secret (docs/kernels.md section 6).
So is its head geometry (query heads, KV heads, head size), which selects the
library (one per head size) and the GQA packing of the tiles, and the kernel
family that runs it: ``path=triton`` forces the Triton ``CONST_TIME`` kernels
(what a GPU without the csrc kernels runs: not sm_90, no nvcc, more query heads
per KV head than the csrc routes take, or the setting ``path: triton``) where
the default (``auto``) runs what the dispatcher picks on this device, the csrc
kernels on an H100 / H200.
`classes.Shape` carries them (``sliding_window``, ``logits_soft_cap``, ``sinks``,
``num_heads``, ``num_kv_heads``, ``head_size``); this module declares the option
both gates share, parses it, and names the features in report rows
(`Features.label`) and in shape keys (`Features.key`).

Syntax of ``--features``: comma-separated items, each at most once, in any order:
``window=W`` (an int >= 1: the row at position q sees keys q - W < p <= q),
``softcap=C`` (a finite number > 0: scores become C tanh(s / C)), ``sinks`` (a
per-head sink logit; the audit's is seeded, the same for every class: a model
weight), ``heads=QxKVxD`` (query heads x KV heads x head size, e.g. 16x8x256 for
Gemma-2 9B's layers; default the audit's Llama-3-8B layer, 32x8x128, which the
label leaves out), ``path=triton`` (or ``path=auto``, the default, which the label
leaves out). ``""`` or ``none``: plain attention on the default geometry and path.
Example: ``heads=16x8x256,window=4096,softcap=50``; ``path=triton,window=1024``.

Torch-free, so that declaring the option costs the command line nothing.
"""

from __future__ import annotations

import dataclasses
import math

ACCEPTED = ("comma-separated items, each at most once: window=W (an int >= 1), softcap=C (a finite number > 0), "
            "sinks, heads=QxKVxD (query heads x KV heads x head size, Q a multiple of KV), path=triton or path=auto; "
            "or 'none' / '' for plain attention (e.g. window=4096,softcap=50,sinks or heads=16x8x256,window=1024 or "
            "path=triton)")
# The kernel families an audited layer can be forced onto (``path=``): the dispatcher's choice (``auto``) or the
# Triton CONST_TIME kernels. The reference path is not constant-time: nothing for G1 or G4 to gate.
PATHS = ("auto", "triton")
# The audit's default layer geometry (classes.Shape's defaults: Llama-3-8B's 32 query heads, 8 KV heads, head
# size 128).
DEFAULT_GEOMETRY = (32, 8, 128)


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
    # (num_heads, num_kv_heads, head_size); () = DEFAULT_GEOMETRY (normalised to (): one spelling per layer)
    geometry: tuple = ()
    path: str = "auto"  # the kernel family (PATHS): the dispatcher's choice, or the Triton kernels forced

    def __post_init__(self):
        g = tuple(self.geometry)
        if g and (len(g) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in g)
                  or g[0] % g[1]):
            raise ValueError(f"geometry is {self.geometry!r}; accepted: (query heads, KV heads, head size), "
                             "positive ints, query heads a multiple of KV heads")
        object.__setattr__(self, "geometry", () if g == DEFAULT_GEOMETRY else g)
        w, c = self.sliding_window, self.logits_soft_cap
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"sliding_window is {w!r}; accepted: 0 (no window) or an int W >= 1")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"logits_soft_cap is {c!r}; accepted: 0 (no cap) or a finite number > 0")
        if not isinstance(self.sinks, bool):
            raise ValueError(f"sinks is {self.sinks!r}; accepted: True or False")
        if self.path not in PATHS:
            raise ValueError(f"path is {self.path!r}; accepted: {', '.join(PATHS)}")

    def __bool__(self) -> bool:
        return bool(self.sliding_window or self.logits_soft_cap or self.sinks or self.geometry
                    or self.path != "auto")

    @property
    def label(self) -> str:
        """The features as ``--features`` spells them (canonical order), "" for none: a report row's
        ``features``."""
        return ",".join(([f"heads={'x'.join(map(str, self.geometry))}"] if self.geometry else [])
                        + ([f"window={self.sliding_window}"] if self.sliding_window else [])
                        + ([f"softcap={_number(self.logits_soft_cap)}"] if self.logits_soft_cap else [])
                        + (["sinks"] if self.sinks else [])
                        + ([f"path={self.path}"] if self.path != "auto" else []))

    @property
    def key(self) -> str:
        """The suffix of `classes.Shape.key` (``-win4096-softcap50-sinks``), "" for none, so plain shapes
        keep their keys (report rows and merges of earlier runs). The geometry is not in it: the key names
        it already (``-h16x8-d256``). A forced path ends it (``-triton``)."""
        return "".join(([f"-win{self.sliding_window}"] if self.sliding_window else [])
                       + ([f"-softcap{_number(self.logits_soft_cap)}"] if self.logits_soft_cap else [])
                       + (["-sinks"] if self.sinks else [])
                       + ([f"-{self.path}"] if self.path != "auto" else []))

    def shape_fields(self) -> dict:
        """Keyword arguments of `classes.Shape` (the geometry's only when it is not the default)."""
        d = {"sliding_window": self.sliding_window, "logits_soft_cap": self.logits_soft_cap, "sinks": self.sinks,
             "path": self.path}
        if self.geometry:
            d.update(zip(("num_heads", "num_kv_heads", "head_size"), self.geometry))
        return d


def of(shape) -> Features:
    """The features of a `classes.Shape` (or anything with its feature, geometry and path fields)."""
    return Features(shape.sliding_window, shape.logits_soft_cap, shape.sinks,
                    (shape.num_heads, shape.num_kv_heads, shape.head_size), getattr(shape, "path", "auto"))


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
        elif name == "heads":
            parts = value.lower().split("x")
            if len(parts) != 3 or not all(x.isdigit() and int(x) >= 1 for x in parts) \
                    or int(parts[0]) % int(parts[1]):
                raise ValueError(f"--features: {item!r} (heads=QxKVxD, positive ints, Q a multiple of KV); "
                                 f"accepted: {ACCEPTED}")
            seen[name] = tuple(int(x) for x in parts)
        elif name == "path":
            if value.lower() not in PATHS:
                raise ValueError(f"--features: {item!r} (path=triton or path=auto); accepted: {ACCEPTED}")
            seen[name] = value.lower()
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
                    sinks=seen.get("sinks", False), geometry=seen.get("heads", ()), path=seen.get("path", "auto"))


def add_argument(parser) -> None:
    """The ``--features`` option, as G1 (`counters`) and G4 (`timing`) both declare it."""
    parser.add_argument("--features", default="",
                        help="attention features of every audited layer: window=W, softcap=C, sinks, and its "
                             "geometry heads=QxKVxD, comma-separated (e.g. window=4096,softcap=50,sinks or "
                             "heads=16x8x256,window=1024; default none: plain attention, 32x8x128), and path=triton "
                             "to force the Triton CONST_TIME kernels. Such layers run the csrc kernels' libraries of "
                             "their head size and features (plan.step_kernel), or with path=triton the Triton ones")
