"""How a decoded image of any shape meets a modality's (height, width): the ``fit`` field of
the ``patch`` kind.

* ``stretch`` -- bilinear resize to the size; the aspect ratio is not kept (the default);
* ``crop`` -- scaled (aspect kept) to cover the size, then the centre cut out;
* ``letterbox`` -- scaled (aspect kept) to fit inside the size, placed at the top-left corner
  of a zero canvas; the content's (height, width) goes with the input as ``<m>_valid`` so that
  the encoder ignores the padding (``omni_jax/modalities/patch.py``). Top-left, like the audio
  padding at a clip's end, so a patch grid row or column is either content or not from one
  edge on.
"""

from __future__ import annotations

from PIL import Image, ImageOps

FITS = ("stretch", "crop", "letterbox")


def fit_image(img: Image.Image, size: tuple[int, int], fit: str
              ) -> tuple[Image.Image, tuple[int, int]]:
  """(``img`` at ``size`` = (height, width), the content's (height, width) in it)."""
  if fit not in FITS:
    raise ValueError(f"image fit must be one of {list(FITS)}, got {fit!r}")
  height, width = size
  if img.size == (width, height):
    return img, (height, width)
  if fit == "stretch":
    return img.resize((width, height), Image.Resampling.BILINEAR), (height, width)
  if fit == "crop":
    return ImageOps.fit(img, (width, height), Image.Resampling.BILINEAR), (height, width)
  small = ImageOps.contain(img, (width, height), Image.Resampling.BILINEAR)
  canvas = Image.new(small.mode, (width, height))  # zeros in every mode
  canvas.paste(small, (0, 0))
  return canvas, (small.height, small.width)
