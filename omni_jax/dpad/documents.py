"""Synthetic identity and business documents, rendered at print resolution with Pillow.

Why: the DPAD paper's SRDID162 set (162 document contents) cannot be downloaded, so the
stack makes its own documents. Five styles (``id_card``, ``certificate``, ``invoice``,
``form``, ``letter``) share drawing primitives — real TrueType fonts, photos from
scikit-image's sample images, tables, rubber stamps, guilloche security backgrounds,
signatures — and every layout choice and word is drawn from a generator seeded by
``(seed, kind)``, so a seed names one document for good.

Every document is returned on a fixed square print canvas (default 640 px) so the jitted
recapture simulator compiles once for all styles; ``doc_box`` says where the paper is.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFont

KINDS = ("id_card", "certificate", "invoice", "form", "letter")
FONT_DIR = "/usr/share/fonts/truetype/dejavu"
FONT_FILES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
              "DejaVuSerif-Italic.ttf", "DejaVuSansMono.ttf", "DejaVuSansCondensed.ttf")
PHOTOS = ("astronaut", "camera", "coffee", "chelsea", "rocket", "cat", "immunohistochemistry",
          "hubble_deep_field", "retina")
_WORDS = ("national", "republic", "identity", "card", "name", "surname", "date", "birth",
          "issued", "valid", "until", "authority", "address", "street", "city", "total",
          "amount", "invoice", "number", "quantity", "price", "tax", "certificate", "awarded",
          "hereby", "honour", "completion", "course", "university", "signature", "official",
          "department", "registry", "applicant", "declare", "information", "correct", "form",
          "section", "reference", "account", "payment", "service", "delivery", "customer",
          "dear", "sincerely", "regards", "meeting", "project", "report", "office", "ministry")
_NAMES = ("Anna", "Boris", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas",
          "Kira", "Luca", "Mara", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tara")
_SURNAMES = ("Novak", "Garcia", "Okafor", "Lindqvist", "Tanaka", "Moreau", "Kowalski", "Silva",
             "Haddad", "Fischer", "Ivanova", "Rossi", "Nguyen", "Costa", "Weber", "Petrov")


@functools.lru_cache(maxsize=64)
def _font(name: str, size: int) -> ImageFont.FreeTypeFont:
  """A TrueType font from the DejaVu family (Debian fonts-dejavu-core)."""
  path = os.path.join(FONT_DIR, name)
  if not os.path.exists(path):
    raise FileNotFoundError(f"font {path} missing: install the Debian package fonts-dejavu-core")
  return ImageFont.truetype(path, size)


@functools.lru_cache(maxsize=16)
def _photo(name: str) -> Image.Image:
  """A scikit-image sample image as an RGB PIL image."""
  import skimage.data
  a = getattr(skimage.data, name)()
  if a.ndim == 2:
    a = np.stack([a] * 3, -1)
  a = a[..., :3]
  if a.dtype != np.uint8:
    a = (255 * (a - a.min()) / max(float(np.ptp(a)), 1e-9)).astype(np.uint8)
  return Image.fromarray(a)


def _words(rng: np.random.Generator, n: int) -> str:
  return " ".join(rng.choice(_WORDS, n))


def _person(rng: np.random.Generator) -> str:
  return f"{rng.choice(_NAMES)} {rng.choice(_SURNAMES)}"


def _colour(rng: np.random.Generator, lo: int = 0, hi: int = 255) -> tuple[int, int, int]:
  return tuple(int(v) for v in rng.integers(lo, hi, 3))


def guilloche(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int],
              rng: np.random.Generator, colour: tuple[int, int, int]) -> None:
  """Security-print rosette: overlapping hypotrochoid-like curves across ``box``."""
  x0, y0, x1, y1 = box
  cx, cy = (x0 + x1) / 2 + rng.uniform(-0.2, 0.2) * (x1 - x0), (y0 + y1) / 2
  rad = 0.6 * max(x1 - x0, y1 - y0)
  k1, k2 = int(rng.integers(3, 9)), int(rng.integers(9, 31))
  t = np.linspace(0, 2 * np.pi, 1400)
  for j in range(int(rng.integers(6, 12))):
    ph = 2 * np.pi * j / 10 + rng.uniform(0, 0.3)
    r = rad * (0.55 + 0.3 * np.cos(k1 * t + ph) + 0.15 * np.sin(k2 * t))
    pts = list(zip(cx + r * np.cos(t), cy + r * np.sin(t) * 0.8, strict=True))
    draw.line(pts, fill=colour, width=1)
  for j in range(int(rng.integers(10, 24))):                 # fine wave lines
    y = y0 + (j + 0.5) * (y1 - y0) / 24
    xs = np.linspace(x0, x1, 200)
    ys = y + 3 * np.sin(xs / rng.uniform(5, 15) + j)
    draw.line(list(zip(xs, ys, strict=True)), fill=colour, width=1)


def stamp(img: Image.Image, centre: tuple[int, int], radius: int, rng: np.random.Generator,
          text: str) -> None:
  """A round rubber stamp (two rings, a star, text) in translucent ink, slightly rotated."""
  size = 2 * radius + 8
  layer = Image.new("RGBA", (size, size), (0, 0, 0, 0))
  d = ImageDraw.Draw(layer)
  ink = (int(rng.integers(150, 220)), 20, 40, 170) if rng.random() < 0.5 else \
        (30, 40, int(rng.integers(140, 210)), 170)
  c = size // 2
  d.ellipse([c - radius, c - radius, c + radius, c + radius], outline=ink, width=3)
  d.ellipse([c - radius + 7, c - radius + 7, c + radius - 7, c + radius - 7], outline=ink, width=1)
  f = _font("DejaVuSans-Bold.ttf", max(8, radius // 5))
  for i, ch in enumerate(text[:18]):
    a = -math.pi / 2 + 2 * math.pi * i / max(len(text[:18]), 1)
    d.text((c + 0.72 * radius * math.cos(a) - 3, c + 0.72 * radius * math.sin(a) - 5), ch,
           font=f, fill=ink)
  star = [(c + (radius * 0.35 if k % 2 == 0 else radius * 0.15) * math.cos(k * math.pi / 5),
           c + (radius * 0.35 if k % 2 == 0 else radius * 0.15) * math.sin(k * math.pi / 5))
          for k in range(10)]
  d.polygon(star, fill=ink)
  layer = layer.rotate(float(rng.uniform(-30, 30)), resample=Image.BICUBIC)
  img.paste(layer, (centre[0] - c, centre[1] - c), layer)


def signature(draw: ImageDraw.ImageDraw, x: int, y: int, w: int, rng: np.random.Generator) -> None:
  """A hand-like scribble: a random smooth curve."""
  t = np.linspace(0, 1, 300)
  xs = x + w * t + 6 * np.sin(t * rng.uniform(15, 40))
  ys = y + 10 * np.sin(t * rng.uniform(8, 25) + rng.uniform(0, 6)) * (1 - 0.5 * t)
  draw.line(list(zip(xs, ys, strict=True)), fill=(20, 30, 90), width=2)


def table(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], rows: int, cols: int,
          rng: np.random.Generator, font: ImageFont.FreeTypeFont, header: bool = True) -> None:
  """A ruled table with a shaded header row and words or numbers in the cells."""
  x0, y0, x1, y1 = box
  rh, cw = (y1 - y0) / rows, (x1 - x0) / cols
  if header:
    draw.rectangle([x0, y0, x1, y0 + rh], fill=_colour(rng, 190, 240))
  for r in range(rows + 1):
    draw.line([(x0, y0 + r * rh), (x1, y0 + r * rh)], fill=(40, 40, 40), width=1)
  for c in range(cols + 1):
    draw.line([(x0 + c * cw, y0), (x0 + c * cw, y1)], fill=(40, 40, 40), width=1)
  for r in range(rows):
    for c in range(cols):
      txt = (str(rng.choice(_WORDS)).upper()[:9] if r == 0 and header else
             (f"{rng.uniform(1, 999):.2f}" if c > 0 else str(rng.choice(_WORDS))[:10]))
      draw.text((x0 + c * cw + 3, y0 + r * rh + 2), txt, font=font, fill=(10, 10, 10))


def paragraph(draw: ImageDraw.ImageDraw, x: int, y: int, w: int, lines: int,
              rng: np.random.Generator, font: ImageFont.FreeTypeFont, step: int) -> int:
  """Random running text, ``lines`` lines starting at (x, y); returns the next free y."""
  per = max(2, int(w / (4.2 * font.size)))
  for _ in range(lines):
    draw.text((x, y), _words(rng, int(rng.integers(max(2, per - 2), per + 2))).capitalize(),
              font=font, fill=(15, 15, 25))
    y += step
  return y


def paste_photo(img: Image.Image, box: tuple[int, int, int, int], rng: np.random.Generator) -> None:
  """A random crop of a random sample photo, resized into ``box``."""
  p = _photo(str(rng.choice(PHOTOS)))
  w, h = box[2] - box[0], box[3] - box[1]
  s = rng.uniform(0.45, 1.0)
  cw, ch = int(p.width * s), int(p.height * s)
  cw, ch = min(cw, int(ch * w / h)), min(ch, int(cw * h / w))
  ox, oy = int(rng.integers(0, p.width - cw + 1)), int(rng.integers(0, p.height - ch + 1))
  img.paste(p.crop((ox, oy, ox + cw, oy + ch)).resize((w, h), Image.BICUBIC), box[:2])


def _id_card(img, d, box, rng):
  x0, y0, x1, y1 = box
  w, h = x1 - x0, y1 - y0
  d.rectangle([x0, y0, x1, y0 + h // 6], fill=_colour(rng, 20, 140))
  d.text((x0 + 12, y0 + 8), f"{rng.choice(_WORDS).upper()} {rng.choice(_WORDS).upper()}",
         font=_font("DejaVuSans-Bold.ttf", h // 12), fill=(255, 255, 255))
  pw = int(w * rng.uniform(0.24, 0.32))
  left = rng.random() < 0.7
  px = x0 + 14 if left else x1 - pw - 14
  paste_photo(img, (px, y0 + h // 5 + 6, px + pw, y0 + h // 5 + 6 + int(pw * 1.25)), rng)
  tx = px + pw + 16 if left else x0 + 14
  f, fs = _font(str(rng.choice(FONT_FILES[:4])), h // 17), _font("DejaVuSans.ttf", h // 26)
  y = y0 + h // 5 + 6
  for label in rng.choice(_WORDS, 5, replace=False):
    d.text((tx, y), str(label).upper(), font=fs, fill=(90, 90, 110))
    d.text((tx, y + h // 24), _person(rng) if rng.random() < 0.4 else
           f"{rng.integers(1, 29):02d}.{rng.integers(1, 13):02d}.{rng.integers(1950, 2010)}",
           font=f, fill=(10, 10, 10))
    y += h // 8
  mrz = _font("DejaVuSansMono.ttf", h // 20)
  for k in range(2):
    d.text((x0 + 12, y1 - (2 - k) * h // 11 - 6),
           "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789<"), 30)), font=mrz,
           fill=(20, 20, 20))
  signature(d, tx, y1 - h // 3, w // 4, rng)


def _certificate(img, d, box, rng):
  x0, y0, x1, y1 = box
  w, h = x1 - x0, y1 - y0
  c = _colour(rng, 60, 170)
  for k in range(3):
    d.rectangle([x0 + 8 + 5 * k, y0 + 8 + 5 * k, x1 - 8 - 5 * k, y1 - 8 - 5 * k], outline=c,
                width=2 - k // 2)
  title = _font(str(rng.choice(["DejaVuSerif-Bold.ttf", "DejaVuSans-Bold.ttf"])), w // 16)
  d.text((x0 + w // 2, y0 + h // 7), "CERTIFICATE", font=title, fill=c, anchor="mm")
  d.text((x0 + w // 2, y0 + h // 7 + w // 14), _words(rng, 4), anchor="mm",
         font=_font("DejaVuSerif-Italic.ttf", w // 34), fill=(40, 40, 40))
  d.text((x0 + w // 2, y0 + h // 3), _person(rng), anchor="mm",
         font=_font("DejaVuSerif-Bold.ttf", w // 20), fill=(10, 10, 10))
  f = _font("DejaVuSerif.ttf", w // 42)
  paragraph(d, x0 + w // 8, y0 + int(h * 0.42), int(w * 0.75), int(rng.integers(3, 7)), rng, f,
            w // 30)
  stamp(img, (x0 + int(w * rng.uniform(0.62, 0.8)), y0 + int(h * 0.78)), int(w * 0.09), rng,
        _words(rng, 2).upper())
  signature(d, x0 + w // 8, y0 + int(h * 0.8), w // 4, rng)


def _invoice(img, d, box, rng):
  x0, y0, x1, y1 = box
  w, h = x1 - x0, y1 - y0
  d.text((x0 + 20, y0 + 20), "INVOICE", font=_font("DejaVuSans-Bold.ttf", w // 14),
         fill=_colour(rng, 0, 120))
  f = _font(str(rng.choice(["DejaVuSans.ttf", "DejaVuSansCondensed.ttf"])), w // 40)
  y = paragraph(d, x0 + int(w * 0.55), y0 + 24, int(w * 0.4), 4, rng, f, w // 32)
  rows = int(rng.integers(5, 12))
  ty = y + 20
  table(d, (x0 + 20, ty, x1 - 20, ty + rows * (w // 26)), rows, int(rng.integers(3, 6)), rng, f)
  d.text((x1 - 200, ty + rows * (w // 26) + 14), f"TOTAL {rng.uniform(100, 9999):.2f}",
         font=_font("DejaVuSans-Bold.ttf", w // 32), fill=(10, 10, 10))
  if rng.random() < 0.7:
    stamp(img, (x0 + int(w * 0.25), y1 - int(h * 0.15)), int(w * 0.08), rng, "PAID " * 3)


def _form(img, d, box, rng):
  x0, y0, x1, y1 = box
  w, h = x1 - x0, y1 - y0
  d.rectangle([x0, y0, x1, y0 + h // 12], fill=_colour(rng, 160, 230))
  d.text((x0 + 16, y0 + 10), _words(rng, 3).upper(), font=_font("DejaVuSans-Bold.ttf", w // 30),
         fill=(20, 20, 20))
  f = _font("DejaVuSans.ttf", w // 44)
  y = y0 + h // 10
  while y < y1 - h // 6:
    if rng.random() < 0.25:
      table(d, (x0 + 20, y, x1 - 20, y + 4 * (w // 30)), 4, int(rng.integers(2, 5)), rng, f)
      y += 4 * (w // 30) + 14
      continue
    d.text((x0 + 20, y), _words(rng, 2).capitalize() + ":", font=f, fill=(30, 30, 30))
    d.rectangle([x0 + int(w * 0.35), y - 2, x1 - 20, y + w // 32], outline=(60, 60, 60))
    if rng.random() < 0.6:
      d.text((x0 + int(w * 0.36), y), _person(rng) if rng.random() < 0.5 else _words(rng, 3),
             font=_font("DejaVuSansMono.ttf", w // 44), fill=(20, 20, 120))
    if rng.random() < 0.3:
      d.rectangle([x1 - 44, y, x1 - 30, y + 14], outline=(0, 0, 0))
    y += w // 20
  signature(d, x0 + w // 2, y1 - h // 10, w // 4, rng)


def _letter(img, d, box, rng):
  x0, y0, x1, y1 = box
  w, h = x1 - x0, y1 - y0
  logo = _colour(rng, 0, 200)
  d.ellipse([x0 + 20, y0 + 20, x0 + 20 + w // 10, y0 + 20 + w // 10], fill=logo)
  d.text((x0 + 30 + w // 10, y0 + 26), _words(rng, 2).title(),
         font=_font("DejaVuSerif-Bold.ttf", w // 24), fill=logo)
  f = _font(str(rng.choice(["DejaVuSerif.ttf", "DejaVuSans.ttf", "DejaVuSansCondensed.ttf"])),
            w // 42)
  y = paragraph(d, x1 - int(w * 0.35), y0 + h // 8, int(w * 0.3), 3, rng, f, w // 34)
  d.text((x0 + 30, y + 16), f"Dear {_person(rng)},", font=f, fill=(10, 10, 10))
  y = paragraph(d, x0 + 30, y + 16 + w // 25, w - 60, int(rng.integers(8, 18)), rng, f, w // 34)
  if rng.random() < 0.4:
    paste_photo(img, (x1 - w // 4, y + 6, x1 - 30, y + 6 + w // 6), rng)
  d.text((x0 + 30, y + 10), "Sincerely,", font=f, fill=(10, 10, 10))
  signature(d, x0 + 30, y + 10 + w // 16, w // 4, rng)


_DRAW = {"id_card": _id_card, "certificate": _certificate, "invoice": _invoice, "form": _form,
         "letter": _letter}
_ASPECT = {"id_card": 85.6 / 54.0, "certificate": 297 / 210, "invoice": 210 / 297,
           "form": 210 / 297, "letter": 210 / 297}


def render_document(kind: str, seed: int, canvas: int = 640) -> tuple[np.ndarray, tuple]:
  """One document of style ``kind`` on a ``canvas`` x ``canvas`` print-resolution RGB page.

  Returns ``(uint8 image (canvas, canvas, 3), doc_box (x0, y0, x1, y1))``; the area outside
  ``doc_box`` is a neutral grey surface. Same ``(kind, seed, canvas)`` -> same pixels.
  """
  if kind not in _DRAW:
    raise ValueError(f"document kind {kind!r} is not known; allowed: {list(KINDS)}")
  if not isinstance(canvas, int) or canvas < 128:
    raise ValueError(f"canvas = {canvas!r} must be an int >= 128 (pixels)")
  rng = np.random.default_rng([seed, KINDS.index(kind), 7])
  aspect = _ASPECT[kind]
  margin = int(canvas * 0.04)
  side = canvas - 2 * margin
  w, h = (side, int(side / aspect)) if aspect >= 1 else (int(side * aspect), side)
  x0, y0 = (canvas - w) // 2, (canvas - h) // 2
  box = (x0, y0, x0 + w, y0 + h)
  img = Image.new("RGB", (canvas, canvas), (128, 128, 128))
  d = ImageDraw.Draw(img)
  d.rectangle(box, fill=_colour(rng, 225, 256))
  guilloche(d, box, rng, _colour(rng, 150, 235))
  _DRAW[kind](img, d, box, rng)
  out = np.full((canvas, canvas, 3), 128, np.uint8)       # guilloche/stamps stay on the paper
  out[box[1]:box[3], box[0]:box[2]] = np.asarray(img, np.uint8)[box[1]:box[3], box[0]:box[2]]
  return out, box
