"""Dependency-free PNG charts: the plot fallback of the G4 timing report when matplotlib is missing.

A raster canvas (RGB bytes), lines, rectangles and a 3x5 pixel font, written
as an 8-bit truecolour PNG with zlib and struct only. Two charts, the ones the
timing gate needs: overlaid histograms of two samples and a line over
samples with threshold lines. Plain on purpose: the report's markdown states
the axes; the pictures are for seeing the shapes.
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (200, 200, 200)
BLUE, ORANGE, RED = (31, 119, 180), (255, 127, 14), (214, 39, 40)
LIGHT_BLUE = (160, 196, 225)

# 3x5 glyphs, rows top to bottom separated by "/", "x" = ink.
_FONT = {
    "0": "xxx/x.x/x.x/x.x/xxx", "1": ".x./xx./.x./.x./xxx", "2": "xxx/..x/xxx/x../xxx", "3": "xxx/..x/.xx/..x/xxx",
    "4": "x.x/x.x/xxx/..x/..x", "5": "xxx/x../xxx/..x/xxx", "6": "xxx/x../xxx/x.x/xxx", "7": "xxx/..x/..x/.x./.x.",
    "8": "xxx/x.x/xxx/x.x/xxx", "9": "xxx/x.x/xxx/..x/xxx", ".": ".../.../.../.../.x.", "-": ".../.../xxx/.../...",
    "+": ".../.x./xxx/.x./...", ":": ".../.x./.../.x./...", "=": ".../xxx/.../xxx/...", "|": ".x./.x./.x./.x./.x.",
    "/": "..x/..x/.x./x../x..", "(": "..x/.x./.x./.x./..x", ")": "x../.x./.x./.x./x..", " ": ".../.../.../.../...",
    "_": ".../.../.../.../xxx", "%": "x.x/..x/.x./x../x.x", ",": ".../.../.../.x./x..",
    "A": ".x./x.x/xxx/x.x/x.x", "B": "xx./x.x/xx./x.x/xx.", "C": ".xx/x../x../x../.xx", "D": "xx./x.x/x.x/x.x/xx.",
    "E": "xxx/x../xx./x../xxx", "F": "xxx/x../xx./x../x..", "G": ".xx/x../x.x/x.x/.xx", "H": "x.x/x.x/xxx/x.x/x.x",
    "I": "xxx/.x./.x./.x./xxx", "J": "..x/..x/..x/x.x/.x.", "K": "x.x/x.x/xx./x.x/x.x", "L": "x../x../x../x../xxx",
    "M": "x.x/xxx/xxx/x.x/x.x", "N": "xx./x.x/x.x/x.x/x.x", "O": ".x./x.x/x.x/x.x/.x.", "P": "xx./x.x/xx./x../x..",
    "Q": ".x./x.x/x.x/xx./.xx", "R": "xx./x.x/xx./x.x/x.x", "S": ".xx/x../.x./..x/xx.", "T": "xxx/.x./.x./.x./.x.",
    "U": "x.x/x.x/x.x/x.x/xxx", "V": "x.x/x.x/x.x/x.x/.x.", "W": "x.x/x.x/xxx/xxx/x.x", "X": "x.x/x.x/.x./x.x/x.x",
    "Y": "x.x/x.x/.x./.x./.x.", "Z": "xxx/..x/.x./x../xxx",
}
_GLYPHS = {k: v.replace("/", "").replace("x", "#").replace(".", " ") for k, v in _FONT.items()}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


class Canvas:
    """An RGB raster with the origin at the top left."""

    def __init__(self, width: int, height: int, background=WHITE) -> None:
        self.w, self.h = int(width), int(height)
        self.px = np.empty((self.h, self.w, 3), np.uint8)
        self.px[:, :] = background

    def rect(self, x0, y0, x1, y1, color) -> None:
        """Fill [x0, x1] x [y0, y1] (inclusive, any order, clipped)."""
        xa, xb = sorted((int(round(x0)), int(round(x1))))
        ya, yb = sorted((int(round(y0)), int(round(y1))))
        xa, ya, xb, yb = max(xa, 0), max(ya, 0), min(xb, self.w - 1), min(yb, self.h - 1)
        if xa <= xb and ya <= yb:
            self.px[ya:yb + 1, xa:xb + 1] = color

    def line(self, x0, y0, x1, y1, color, dash: int = 0) -> None:
        """A straight line, sampled densely enough to leave no gaps; ``dash`` > 0 draws dashes of that length."""
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(steps + 1):
            if dash and (i // dash) % 2:
                continue
            f = i / steps
            x, y = int(round(x0 + (x1 - x0) * f)), int(round(y0 + (y1 - y0) * f))
            if 0 <= x < self.w and 0 <= y < self.h:
                self.px[y, x] = color

    def text(self, x, y, s: str, color=BLACK, scale: int = 2) -> None:
        """Upper-case text in the 3x5 font, top-left at (x, y); unknown characters print as blanks."""
        for k, ch in enumerate(s.upper()):
            g = _GLYPHS.get(ch, _GLYPHS[" "])
            for r in range(5):
                for c in range(3):
                    if g[r * 3 + c] == "#":
                        px, py = x + (k * 4 + c) * scale, y + r * scale
                        self.rect(px, py, px + scale - 1, py + scale - 1, color)

    def png_bytes(self) -> bytes:
        raw = b"".join(b"\x00" + self.px[r].tobytes() for r in range(self.h))  # filter 0 on every row
        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
        return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(
            b"IEND", b"")

    def write(self, path: str) -> str:
        with open(path, "wb") as f:
            f.write(self.png_bytes())
        return path


def _fmt(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return str(v)
    return f"{v:.4g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"


class _Frame:
    """The plotting area of a canvas with data-to-pixel mapping and labelled axes."""

    def __init__(self, c: Canvas, xlim, ylim, title: str, xlabel: str, ylabel: str) -> None:
        self.c, (self.x0, self.x1), (self.y0, self.y1) = c, xlim, ylim
        self.left, self.right, self.top, self.bottom = 70, c.w - 20, 40, c.h - 50
        c.text(self.left, 10, title, scale=2)
        c.line(self.left, self.bottom, self.right, self.bottom, BLACK)
        c.line(self.left, self.top, self.left, self.bottom, BLACK)
        c.text(self.left, self.bottom + 8, _fmt(self.x0))
        lab = _fmt(self.x1)
        c.text(self.right - 8 * len(lab), self.bottom + 8, lab)
        c.text((self.left + self.right) // 2 - 4 * len(xlabel), self.bottom + 28, xlabel)
        c.text(4, self.top, _fmt(self.y1))
        c.text(4, self.bottom - 10, _fmt(self.y0))
        c.text(4, (self.top + self.bottom) // 2, ylabel)

    def px(self, x: float, y: float) -> tuple[float, float]:
        fx = (x - self.x0) / ((self.x1 - self.x0) or 1.0)
        fy = (y - self.y0) / ((self.y1 - self.y0) or 1.0)
        return self.left + fx * (self.right - self.left), self.bottom - fy * (self.bottom - self.top)


def histograms(path: str, a, b, *, labels=("A", "B"), title: str = "", xlabel: str = "US", bins: int = 80,
               width: int = 720, height: int = 420) -> str:
    """Two samples' histograms on shared bins over their pooled 0.1..99.9 % range: A filled, B as a step line."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    lo, hi = np.quantile(np.concatenate([a, b]), [0.001, 0.999])
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    ha, _ = np.histogram(a, edges)
    hb, _ = np.histogram(b, edges)
    c = Canvas(width, height)
    f = _Frame(c, (lo, hi), (0, max(int(ha.max()), int(hb.max()), 1)), title, xlabel, "N")
    for i in range(bins):
        xa, _ = f.px(edges[i], 0)
        xb, ytop = f.px(edges[i + 1], ha[i])
        if ha[i]:
            c.rect(xa, ytop, xb, f.bottom - 1, LIGHT_BLUE)
    prev = None
    for i in range(bins):
        xa, y = f.px(edges[i], hb[i])
        xb, _ = f.px(edges[i + 1], hb[i])
        if prev is not None:
            c.line(xa, prev, xa, y, ORANGE)
        c.line(xa, y, xb, y, ORANGE)
        prev = y
    c.rect(f.right - 150, f.top, f.right - 140, f.top + 10, LIGHT_BLUE)
    c.text(f.right - 134, f.top, labels[0][:16])
    c.rect(f.right - 150, f.top + 18, f.right - 140, f.top + 20, ORANGE)
    c.text(f.right - 134, f.top + 14, labels[1][:16])
    return c.write(path)


def series(path: str, xs, ys, *, hlines=(), title: str = "", xlabel: str = "N", ylabel: str = "T",
           width: int = 720, height: int = 360) -> str:
    """A line through (xs, ys) with dashed horizontal lines (thresholds) and a grey zero line."""
    xs, ys = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    ok = np.isfinite(xs) & np.isfinite(ys)
    xs, ys = xs[ok], ys[ok]
    span = max([abs(h) for h in hlines] + [float(np.abs(ys).max()) if ys.size else 1.0]) * 1.1
    xlim = (float(xs.min()), float(xs.max())) if xs.size else (0.0, 1.0)
    c = Canvas(width, height)
    f = _Frame(c, xlim, (-span, span), title, xlabel, ylabel)
    c.line(f.left, f.px(0, 0)[1], f.right, f.px(0, 0)[1], GREY)
    for h in hlines:
        y = f.px(0, h)[1]
        c.line(f.left, y, f.right, y, RED, dash=6)
    pts = [f.px(x, y) for x, y in zip(xs, ys)]
    for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
        c.line(xa, ya, xb, yb, BLUE)
    if len(pts) == 1:
        c.rect(pts[0][0] - 1, pts[0][1] - 1, pts[0][0] + 1, pts[0][1] + 1, BLUE)
    return c.write(path)


def read_header(data: bytes) -> dict:
    """Signature check and IHDR fields of PNG bytes (used by the tests and the report's self-check)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG: bad signature")
    length, kind = struct.unpack(">I4s", data[8:16])
    if kind != b"IHDR" or length != 13:
        raise ValueError("not a PNG: first chunk is not IHDR")
    w, h, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", data[16:29])
    crc = struct.unpack(">I", data[29:33])[0]
    if crc != zlib.crc32(data[12:29]) & 0xFFFFFFFF:
        raise ValueError("not a PNG: IHDR CRC mismatch")
    return {"width": w, "height": h, "bit_depth": depth, "colour_type": colour}
