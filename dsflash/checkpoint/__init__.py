"""Checkpoints: the official Hugging Face safetensors layout (read + tiny writer) and orbax save/restore.

* :func:`load_checkpoint` — official layout (SPEC_V41 §13) -> ``(cfg, params)`` in the stored formats,
  streamed shard by shard, straight into the given shardings.
* :func:`write_synthetic_checkpoint` (``dsflash.checkpoint.synth``) — tiny random checkpoints in that
  exact layout, plus a tokenizer.
* :func:`save_params` / :func:`restore_params` — orbax-checkpoint of converted, sharded params.
* :func:`check_checkpoint` / ``python -m dsflash.checkpoint FOLDER`` — validate a checkpoint from its headers.

See ``docs/checkpoints.md``.
"""
from dsflash.checkpoint.loader import (CheckpointError, check_checkpoint, expert_slots_from_phy2log, load_checkpoint,
                                      read_weight_map)
from dsflash.checkpoint.names import official_inventory, split_official
from dsflash.checkpoint.orbax_io import restore_params, save_params
from dsflash.checkpoint.safetensors_io import SafetensorsError, SafetensorsFile, write_safetensors


def write_synthetic_checkpoint(*args, **kwargs):
    """See :func:`dsflash.checkpoint.synth.write_synthetic_checkpoint`."""
    from dsflash.checkpoint.synth import write_synthetic_checkpoint as _w
    return _w(*args, **kwargs)


__all__ = ["CheckpointError", "SafetensorsError", "SafetensorsFile", "check_checkpoint", "expert_slots_from_phy2log",
           "load_checkpoint",
           "official_inventory", "read_weight_map", "restore_params", "save_params", "split_official",
           "write_safetensors", "write_synthetic_checkpoint"]
