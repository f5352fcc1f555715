"""Real encoded test images, made here: JPEG and PNG in the modes and quirks clients send."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image
from qwen3vl_trt.qa.tiny import synthetic_jpeg, synthetic_photo


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def jpeg(height: int, width: int, seed: int = 0, **kwargs) -> bytes:
    return synthetic_jpeg(height, width, seed, **kwargs)


def exif_rotated_jpeg(height: int, width: int, orientation: int, seed: int = 0) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return jpeg(height, width, seed, exif=exif.tobytes())


def xmp_rotated_jpeg(height: int, width: int, orientation: int, seed: int = 0) -> bytes:
    """Orientation in XMP (tiff:Orientation) only, as some editors write it; Pillow and transformers honour it."""
    xmp = (
        '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="{orientation}"/>'
        "</rdf:RDF></x:xmpmeta>"
    ).encode()
    return encode(Image.fromarray(synthetic_photo(height, width, seed)), "JPEG", quality=90, xmp=xmp)


def gray_jpeg(height: int, width: int, seed: int = 0) -> bytes:
    return encode(Image.fromarray(synthetic_photo(height, width, seed)[..., 1]), "JPEG", quality=90)


def cmyk_jpeg(height: int, width: int, seed: int = 0) -> bytes:
    return encode(Image.fromarray(synthetic_photo(height, width, seed)).convert("CMYK"), "JPEG", quality=90)


def png(height: int, width: int, seed: int = 0) -> bytes:
    return encode(Image.fromarray(synthetic_photo(height, width, seed)), "PNG")


def rgba_png(height: int, width: int, seed: int = 0) -> bytes:
    rgb = synthetic_photo(height, width, seed)
    alpha = np.linspace(0, 255, width, dtype=np.uint8)[None, :].repeat(height, axis=0)
    return encode(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), "PNG")


def la_png(height: int, width: int, seed: int = 0) -> bytes:
    gray = synthetic_photo(height, width, seed)[..., 0]
    alpha = np.linspace(255, 0, height, dtype=np.uint8)[:, None].repeat(width, axis=1)
    return encode(Image.fromarray(np.dstack([gray, alpha]), "LA"), "PNG")


def palette_png(height: int, width: int, seed: int = 0) -> bytes:
    image = Image.fromarray(synthetic_photo(height, width, seed)).quantize(colors=64)
    return encode(image, "PNG", transparency=0)


def gray16_png(height: int, width: int, seed: int = 0) -> bytes:
    values = synthetic_photo(height, width, seed)[..., 0].astype(np.uint16) * 257
    return encode(Image.fromarray(values), "PNG")  # uint16 -> mode I;16


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny compressed row: a decompression bomb's shape."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


# name -> bytes; every kind the parity tests cover.
def parity_images() -> dict[str, bytes]:
    return {
        "jpeg 640x480": jpeg(480, 640, 1),
        "jpeg 4:4:4 non-square 517x333": jpeg(333, 517, 2, subsampling=0),
        "progressive jpeg 300x200": jpeg(200, 300, 3, progressive=True),
        "tiny jpeg 32x32": jpeg(32, 32, 4),
        "exif-rotated jpeg (6)": exif_rotated_jpeg(120, 200, 6, 5),
        "exif-mirrored jpeg (2)": exif_rotated_jpeg(90, 160, 2, 6),
        "grayscale jpeg": gray_jpeg(150, 220, 7),
        "cmyk jpeg": cmyk_jpeg(140, 180, 8),
        "png 400x300": png(300, 400, 9),
        "rgba png": rgba_png(160, 240, 10),
        "palette png with transparency": palette_png(128, 192, 11),
        "la png (gray + alpha)": la_png(90, 140, 13),
        "xmp-rotated jpeg (8)": xmp_rotated_jpeg(100, 60, 8, 14),
    }
