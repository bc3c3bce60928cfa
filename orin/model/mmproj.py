"""Deterministic random-weight vision projectors for the demo models.

Vision tests and the demo server need a multimodal projector (an "mmproj"
GGUF, llama.cpp's tools/mtmd format) whose output width matches a demo text
model, and none may be downloaded, so it is generated like the demo models: a
seeded numpy Generator fills the tensors of a tiny CLIP-style vision tower
with LLaVA's two-layer MLP projector (``clip.projector_type`` ``mlp``), the
projector type with the fewest tensors that clip.cpp runs with a causal,
linear-position decoder, so image embeddings go into any llama model's batch
like tokens. A 32-pixel image in 8-pixel patches gives 16 image tokens,
encoded in about a millisecond on a CPU. Same text size and seed always give a
byte-identical file.

The projector's output rows are scaled like the demo model's token
embeddings, so an image shifts the answer through attention the way prompt
text does, without deciding it: greedy output stays stable across batching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from orin.errors import DemoModelError
from orin.model.demo import SIZES, _publish, _temp_path
from orin.paths import models_cache_dir

FORMAT_VERSION = 1
"""Part of cached file names: bump on any change to the weights or metadata."""

ARCH = "clip"
PROJECTOR_TYPE = "mlp"
LAYER_NORM_EPS = 1e-6
# CLIP's normalization constants, as the LLaVA projectors carry them
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionShape:
    """The vision tower's hyperparameters. n_ff differs from n_embd on purpose:
    clip.cpp takes an ffn_down whose rows equal n_embd for an old, swapped
    export and would swap it back."""

    image_size: int = 32
    patch_size: int = 8
    n_embd: int = 32
    n_head: int = 2
    n_ff: int = 48
    n_layer: int = 2  # LLaVA reads the second-to-last layer: one layer runs
    n_mm_hidden: int = 64

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


VISION = VisionShape()


def image_tokens(shape: VisionShape = VISION) -> int:
    """Image tokens one picture becomes (the patch grid; no class token)."""
    return shape.n_patches


def _text_width(size: str) -> int:
    if size not in SIZES:
        raise DemoModelError(f"unknown demo model size {size!r}; valid: {', '.join(SIZES)}")
    return SIZES[size].n_embd


def file_name(size: str) -> str:
    """Cache file name of the projector for the demo text model of ``size``."""
    _text_width(size)
    return f"orin-demo-mmproj-{size}-v{FORMAT_VERSION}.gguf"


def ensure(size: str, cache: Path | None = None) -> Path:
    """The cached projector for the demo model of ``size`` (seed 0), generated on
    first use; concurrent callers each rename a complete, identical file in place."""
    path = (cache if cache is not None else models_cache_dir()) / file_name(size)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return generate(size, path)


def generate(size: str, out: Path, seed: int = 0) -> Path:
    """Write the projector for the demo text model of ``size`` to ``out`` atomically."""
    n_text = _text_width(size)
    if not 0 <= seed < 2**32:
        raise DemoModelError(f"projector seed must be in [0, 2**32), not {seed}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _temp_path(out, ".mmproj") as raw:
        _write(raw, size, n_text, VISION, seed)
        _publish(raw, out)
    return out


def _write(path: Path, size: str, n_text: int, shape: VisionShape, seed: int) -> None:
    w = gguf.GGUFWriter(path, ARCH)
    w.add_name(f"orin-llm demo {size} vision projector")
    w.add_file_type(0)  # all f32
    w.add_string("clip.projector_type", PROJECTOR_TYPE)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", shape.image_size)
    w.add_uint32("clip.vision.patch_size", shape.patch_size)
    w.add_uint32("clip.vision.embedding_length", shape.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", shape.n_ff)
    w.add_uint32("clip.vision.block_count", shape.n_layer)
    w.add_uint32("clip.vision.projection_dim", n_text)
    w.add_uint32("clip.vision.attention.head_count", shape.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", LAYER_NORM_EPS)
    w.add_array("clip.vision.image_mean", list(IMAGE_MEAN))
    w.add_array("clip.vision.image_std", list(IMAGE_STD))
    w.add_uint32("orin_llm.demo.format_version", FORMAT_VERSION)
    w.add_string("orin_llm.demo.size", size)
    w.add_uint32("orin_llm.demo.seed", seed)
    for name, tensor in weights(shape, n_text, seed).items():
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def weights(shape: VisionShape, n_text: int, seed: int) -> dict[str, np.ndarray]:
    """All tensors, f32, named and shaped (numpy's last axis is ggml's ne0) as
    clip.cpp's loader and its LLaVA graph expect."""
    rng = np.random.default_rng(seed)
    n, p = shape.n_embd, shape.patch_size

    def normal(*dims: int, var: float) -> np.ndarray:
        return rng.standard_normal(dims, dtype=np.float32) * np.float32(np.sqrt(var))

    out: dict[str, np.ndarray] = {
        # ggml ne = [p, p, 3, n_embd]: a convolution with stride p
        "v.patch_embd.weight": normal(n, 3, p, p, var=1.0 / (3 * p * p)),
        "v.position_embd.weight": normal(shape.n_patches, n, var=0.1),
        "v.pre_ln.weight": np.ones(n),
        "v.pre_ln.bias": np.zeros(n),
    }
    for il in range(shape.n_layer):
        blk = f"v.blk.{il}"
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out[f"{blk}.{part}.weight"] = normal(n, n, var=1.0 / n)
            out[f"{blk}.{part}.bias"] = np.zeros(n)
        out[f"{blk}.ln1.weight"] = np.ones(n)
        out[f"{blk}.ln1.bias"] = np.zeros(n)
        out[f"{blk}.ln2.weight"] = np.ones(n)
        out[f"{blk}.ln2.bias"] = np.zeros(n)
        out[f"{blk}.ffn_up.weight"] = normal(shape.n_ff, n, var=1.0 / n)
        out[f"{blk}.ffn_up.bias"] = np.zeros(shape.n_ff)
        out[f"{blk}.ffn_down.weight"] = normal(n, shape.n_ff, var=1.0 / shape.n_ff)
        out[f"{blk}.ffn_down.bias"] = np.zeros(n)
    h = shape.n_mm_hidden
    out["mm.0.weight"] = normal(h, n, var=1.0 / n)
    out["mm.0.bias"] = np.zeros(h)
    # rows of about unit variance per entry: the demo model's token embeddings' scale
    out["mm.2.weight"] = normal(n_text, h, var=2.0 / h)
    out["mm.2.bias"] = np.zeros(n_text)
    return {name: t.astype(np.float32) for name, t in out.items()}


# -- any projector's metadata: memory and fit checks ---------------------------------

# projector types whose image tokens need non-causal attention over the image or M-RoPE
# positions: the engine refuses them when it loads them (orin/engine/vision.py)
UNSUPPORTED_TYPES = frozenset(
    {
        "gemma3",
        "gemma4v",
        "gemma4uv",
        "deepseek4v",
        "qwen2vl_merger",
        "qwen2.5vl_merger",
        "qwen3vl_merger",
        "qwen2.5o",
        "glm4v",
        "glm5v",
    }
)


@dataclass(frozen=True)
class ProjectorInfo:
    """A projector GGUF's metadata, read without loading weights."""

    path: Path
    projector_type: str
    has_vision: bool
    n_embd: int  # the vision tower's width
    n_ff: int
    n_head: int
    n_layer: int
    image_size: int
    patch_size: int
    projection_dim: int  # clip.vision.projection_dim (CLIP's own; not the output width)
    output_width: int  # the width of the image rows it makes (0: unknown for its type)
    weights_bytes: int

    @property
    def n_patches(self) -> int:
        side = self.image_size // self.patch_size if self.patch_size else 0
        return side * side

    @property
    def compute_bytes(self) -> int:
        """Estimate of clip.cpp's compute buffer for one image (f32): a few n_embd- and
        two n_ff-wide activations per patch, one layer's attention scores (heads x
        patches x patches) and the output rows; x2 for the graph's intermediate copies.
        It errs on the high side, like the text model's estimate."""
        n = self.n_patches + 1  # a class token, where the tower has one
        act = 4 * n * (6 * self.n_embd + 2 * self.n_ff + self.output_width)
        scores = 4 * self.n_head * n * n
        return 2 * (act + scores)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.compute_bytes


class BrokenProjector(ValueError):
    """A projector GGUF (general.architecture clip) whose tensors the file cannot hold."""


def read_projector_info(path: Path) -> ProjectorInfo:
    """The metadata of a projector GGUF; ValueError when it is not one (the callers
    name the file), BrokenProjector when it is one cut short. The output width comes
    from the last projector matrix where the type's layout is known (LLaVA's mm.2).
    Read as the language models are (orin.model.ggufread): a FIFO, an array of arrays
    or a broken tensor table is a GGUFFormatError (a ValueError), not a wait or a
    RecursionError."""
    from orin.model.ggufread import open_gguf

    with open_gguf(Path(path)) as contents:
        fields, tensors = contents.fields, contents.tensors
    arch = fields.get("general.architecture", "")
    if arch != ARCH:
        raise ValueError(f"general.architecture is {arch!r}, not 'clip': not a projector")
    size = Path(path).stat().st_size
    for t in tensors:  # llama.cpp maps the file: a short one is a crash, not an error
        if t.data_offset + t.n_bytes > size:
            raise BrokenProjector(
                f"truncated GGUF file (a vision projector): tensor {t.name} ends at byte "
                f"{t.data_offset + t.n_bytes}, file has {size}"
            )
    proj = fields.get("clip.projector_type") or fields.get("clip.vision.projector_type") or ""

    def u(key: str) -> int:
        v = fields.get(f"clip.vision.{key}", 0)
        return int(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0

    shapes = {t.name: list(t.shape) for t in tensors}
    last = shapes.get("mm.2.weight")  # ggml order: [n_in, n_out]
    return ProjectorInfo(
        path=Path(path),
        projector_type=str(proj),
        has_vision=bool(fields.get("clip.has_vision_encoder", False)),
        n_embd=u("embedding_length"),
        n_ff=u("feed_forward_length"),
        n_head=u("attention.head_count"),
        n_layer=u("block_count"),
        image_size=u("image_size"),
        patch_size=u("patch_size"),
        projection_dim=u("projection_dim"),
        output_width=last[1] if last and len(last) == 2 else 0,
        weights_bytes=sum(t.n_bytes for t in tensors),
    )


def fit_problem(proj: ProjectorInfo, text_n_embd: int) -> str | None:
    """Why this projector cannot serve images for a text model of that width, or None."""
    if not proj.has_vision:
        return "the projector has no vision encoder (clip.has_vision_encoder is not set)"
    if proj.projector_type in UNSUPPORTED_TYPES:
        return (
            f"projector type {proj.projector_type} needs non-causal attention over an image "
            "or M-RoPE positions, which the engine does not support"
        )
    if proj.output_width and proj.output_width != text_n_embd:
        return (
            f"the projector's output is {proj.output_width} wide; the model's embeddings "
            f"are {text_n_embd}: it was made for another model"
        )
    return None
