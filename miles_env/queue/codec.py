"""An Episode at rest: JSON metadata plus packed token arrays, and the checksum that guards them.

Concept: the replay queue stores each episode as two values, `meta` (JSON of everything but the
token arrays) and `arrays` (int32 ids, uint8 mask, float64 logprobs, sample after sample). The
logprobs are the importance-sampling reference, so the packing is lossless (float64). A MoE
sample's `routed_experts` (only when present) follows its logprobs as its raw packed ids, its shape
in the sample's JSON (`layers`, `top_k`, `itemsize`, `nbytes`).

Invariant: `decode_episode(*encode_episode(e)) == e`, bit for bit; and `payload_checksum` of
the stored bytes equals the one taken at `put` unless the bytes changed at rest. SQLite's own
integrity check sees only its page structure, not a flipped bit inside a BLOB, so the queue
verifies this checksum before it hands an episode to the trainer.
"""

from __future__ import annotations

import hashlib
import json
from array import array

from miles_env.types import Episode, RoutedExperts, Trajectory, Turn

__all__ = ["encode_episode", "decode_episode", "payload_checksum"]

_TOKEN_FIELDS = {"token_ids", "loss_mask", "logprobs", "routed_experts"}


def encode_episode(episode: Episode) -> tuple[str, bytes]:
    """Episode -> (JSON metadata, packed token arrays). Token ids int32, mask uint8, logprobs float64
    (lossless: the rollout logprobs are the importance-sampling reference)."""
    meta = episode.model_dump(mode="json", exclude={"samples"})
    meta["samples"] = [s.model_dump(mode="json", exclude=_TOKEN_FIELDS) for s in episode.samples]
    meta["lens"] = [len(s.token_ids) for s in episode.samples]
    parts: list[bytes] = []
    for s, sm in zip(episode.samples, meta["samples"], strict=True):
        parts.append(array("i", s.token_ids).tobytes())
        parts.append(bytes(s.loss_mask))
        parts.append(array("d", s.logprobs).tobytes())
        if (r := s.routed_experts) is not None:
            parts.append(raw := r.raw())
            sm["routed_experts"] = {"layers": r.layers, "top_k": r.top_k, "itemsize": r.itemsize,
                                    "nbytes": len(raw)}  # fmt: skip
    return json.dumps(meta, separators=(",", ":")), b"".join(parts)


def decode_episode(meta_json: str, blob: bytes) -> Episode:
    """Inverse of encode_episode. The data was validated at `put`, so it is rebuilt without
    re-running the per-token validators (they dominate decode time for long trajectories)."""
    meta = json.loads(meta_json)
    lens = meta.pop("lens")
    samples = []
    off = 0
    for sm, n in zip(meta.pop("samples"), lens, strict=True):
        ids = array("i")
        ids.frombytes(blob[off : off + 4 * n])
        off += 4 * n
        mask = list(blob[off : off + n])
        off += n
        lps = array("d")
        lps.frombytes(blob[off : off + 8 * n])
        off += 8 * n
        if (shape := sm.pop("routed_experts", None)) is not None:
            nbytes = shape.pop("nbytes")
            sm["routed_experts"] = RoutedExperts.from_raw(blob[off : off + nbytes], **shape)
            off += nbytes
        turns = [Turn.model_validate(t) for t in sm.pop("turns")]
        samples.append(
            Trajectory.model_construct(
                token_ids=ids.tolist(), loss_mask=mask, logprobs=lps.tolist(), turns=turns, **sm
            )
        )
    return Episode.model_validate({**meta, "samples": []}).model_copy(update={"samples": samples})


def payload_checksum(meta: str | bytes, blob: bytes) -> str:
    """sha256 (hex) over both stored values; the length prefix keeps the boundary between them
    part of what is checked."""
    raw = meta.encode() if isinstance(meta, str) else meta
    h = hashlib.sha256(len(raw).to_bytes(8, "little"))
    h.update(raw)
    h.update(blob)
    return h.hexdigest()
