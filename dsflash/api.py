"""The notebook entry point: ``dsflash.load(path_or_preset, **options) -> Model``.

A ``Model`` bundles config, params, tokenizer (if any) and run options, and offers the few calls a
researcher needs: full-prefill ``logits``, a stateful ``forward`` for prefill/decode experiments, and
DSpark ``propose``. Everything is a thin layer over the pure functions of ``dsflash.model``.
"""
from __future__ import annotations

import logging
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from dsflash import compile_options
from dsflash.config import PRESETS, ModelConfig, preset
from dsflash.model import dspark
from dsflash.model.forward import forward_jit
from dsflash.model.params import check_params, init_params_placed
from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch

log = logging.getLogger(__name__)


def _token_map(cfg: ModelConfig, tokenizer):
    """SPEC §9.2 compressed-id map from the tokenizer; identity for synthetic checkpoints whose config
    declares the identity (compressed vocab == vocab, SPEC §13.6)."""
    if tokenizer is None or not cfg.engram_layer_ids:
        return None
    from dsflash.engram_map import build_compressed_token_map
    table, n = build_compressed_token_map(tokenizer)
    if n == cfg.engram_compressed_vocab_size:
        return jnp.asarray(table, jnp.int32)
    if cfg.engram_compressed_vocab_size == cfg.vocab_size:
        return None
    raise ValueError(f"ModelConfig.engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size} but the "
                     f"tokenizer's compressed vocabulary (SPEC §9.2) has {n} ids")


_update_context_jit = compile_options.jit(dspark.update_context, static_argnums=(1, 7))
_propose_jit = compile_options.jit(dspark.propose, static_argnums=(1, 6))


class Model:
    def __init__(self, cfg: ModelConfig, params: dict, tokenizer=None, opts: RunOptions = RunOptions(),
                 name: str = "model", mesh=None, strategy: str = "dep"):
        check_params(cfg, params)
        self.cfg, self.params, self.tokenizer, self.opts, self.name = cfg, params, tokenizer, opts, name
        self.mesh, self.strategy, self.routed_fn, self.dp = mesh, strategy, None, 1
        if mesh is not None:
            from dsflash.sharding.ep_moe import make_routed_fn
            from dsflash.sharding.rules import token_axes
            self.routed_fn = make_routed_fn(mesh)            # expert-parallel routed MoE over the mesh
            self.dp = int(np.prod([mesh.shape[a] for a in token_axes(mesh, strategy)]))
        tmap = _token_map(cfg, tokenizer)
        if tmap is not None:
            self.params = dict(params, **{"engram.token_map": tmap})

    # ------------------------------------------------------------------ state
    def init_state(self, batch_size: int = 1, max_len: int = 512, page_size: int | None = None,
                   ring_slack: int = 16, precision: str | None = None):
        """A fresh session. Its caches are laid out for ``precision`` (default: the model's), and every
        ``forward`` on it must run at that precision."""
        ps = page_size or self.opts.page_size
        precision = precision or self.opts.precision
        pages = -(-max_len // ps)
        slots = -(-batch_size // self.dp) * self.dp            # rows shard over the DP axes
        geo = CacheGeometry(num_slots=slots, num_pages=slots * pages, page_size=ps, ring_slack=ring_slack)
        state = init_state(self.cfg, geo, precision)
        if self.mesh is not None:
            from dsflash.sharding.rules import state_shardings
            state = jax.device_put(state, state_shardings(state, self.mesh, self.strategy))
        return {"state": state, "pages_per_seq": pages, "page_size": ps, "max_len": pages * ps,
                "precision": precision}

    def forward(self, token_ids, session, start=0, lengths=None, **opts):
        """One forward over ``token_ids`` [B, S] at positions start.. (int or per row). ``session`` comes from
        ``init_state``; it is updated in place. Options override the model's RunOptions (e.g. logits="all")."""
        tokens = self._tokens(token_ids)
        B = tokens.shape[0]
        n_slots = session["state"]["engram_hist"].shape[0]
        if B > n_slots:
            raise ValueError(f"token_ids: batch of {B} rows but the session was made for {n_slots}")
        start = np.broadcast_to(np.asarray(start, np.int32), (B,))
        if start.min() < 0 or start.max() + tokens.shape[1] > session["max_len"]:
            raise ValueError(f"start: positions {start.min()}..{start.max() + tokens.shape[1] - 1} do not fit the "
                             f"session's max_len={session['max_len']}")
        lengths = np.full((B,), tokens.shape[1], np.int32) if lengths is None else np.asarray(lengths, np.int32)
        if self.mesh is not None and B < n_slots:              # pad with idle rows to the sharded row count
            pad = n_slots - B
            tokens = jnp.concatenate([tokens, jnp.zeros((pad, tokens.shape[1]), jnp.int32)])
            start, lengths = np.concatenate([start, np.zeros(pad, np.int32)]), np.concatenate([lengths, np.zeros(pad, np.int32)])
        batch = make_batch(tokens, start=start, lengths=lengths, pages_per_seq=session["pages_per_seq"])
        if self.mesh is not None:
            from dsflash.sharding.rules import batch_shardings
            batch = jax.device_put(batch, batch_shardings(batch, self.mesh, self.strategy))
        o = self.opts.replace(page_size=session["page_size"], **opts)
        if o.precision != session.get("precision", o.precision):
            raise ValueError(f"precision: the session's caches were made for precision={session['precision']!r}, "
                             f"not {o.precision!r}; make it with init_state(..., precision={o.precision!r})")
        out, session["state"] = forward_jit(self.params, self.cfg, batch, session["state"], o, self.routed_fn)
        return {k: (v[:B] if k != "expert_load" else v) for k, v in out.items()}

    def logits(self, token_ids, **opts):
        """Full-prefill logits ``[batch, seq, vocab]`` (float32, numpy) of a fresh sequence per row."""
        tokens = self._tokens(token_ids)
        sess = self.init_state(tokens.shape[0], max(tokens.shape[1], 1), precision=opts.get("precision"))
        return np.asarray(self.forward(tokens, sess, logits="all", **opts)["logits"])

    def propose(self, token_ids, y=None, **opts):
        """Prefill ``token_ids`` [B, S], seed the DSpark context from the taps, draft a block after ``y``
        (default: the target's greedy next token). Returns numpy dict(drafts, logits, confidence, y)."""
        tokens = self._tokens(token_ids)
        B, S = tokens.shape
        sess = self.init_state(B, S + self.cfg.dspark_block_size + 1, precision=opts.get("precision"))
        opts = dict(opts, taps=True, logits="last")
        o = self.opts.replace(**opts)
        out = self.forward(tokens, sess, **opts)
        slots = jnp.arange(B, dtype=jnp.int32)
        st = _update_context_jit(self.params, self.cfg, out["taps"], out["taps_start"], out["taps_lengths"],
                                 slots, sess["state"], o)
        if y is None:
            y = jnp.argmax(out["logits"], axis=-1)
        y = jnp.asarray(y, jnp.int32).reshape(B)
        res = _propose_jit(self.params, self.cfg, st, y, jnp.full((B,), S, jnp.int32), slots, o)
        return {k: np.asarray(v) for k, v in res.items()} | {"y": np.asarray(y)}

    def _tokens(self, token_ids):
        if isinstance(token_ids, str):
            if self.tokenizer is None:
                raise ValueError("token_ids: this model has no tokenizer; pass token ids")
            token_ids = [self.tokenizer.encode(token_ids)]
        arr = np.asarray(token_ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token_ids must be [batch, seq] integers, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.cfg.vocab_size):
            raise ValueError(f"token_ids must be in [0, {self.cfg.vocab_size}), got range [{arr.min()}, {arr.max()}]")
        return jnp.asarray(arr, jnp.int32)

    def __repr__(self):
        return f"Model({self.name}, layers={self.cfg.num_hidden_layers}, d={self.cfg.hidden_size}, opts={self.opts})"


#: trained checkpoints that ship inside the package (official layout), loadable by name
SHIPPED = {"demo": os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo")}


def load(model: str | os.PathLike = "demo", *, seed: int = 0, precision: str = "reference",
         bounded_replay: str | None = None, replay_tail: int | None = None, backend: str = "auto",
         page_size: int = 64, mesh=None, strategy: str = "dep", progress: bool = True,
         engram_tables: str = "device", **cfg_overrides) -> Model:
    """A shipped model (``"demo"``: the trained demo model, the default), a preset name (deterministic
    random weights from ``seed``) or an official checkpoint folder.

    ``engram_tables="host"`` keeps the Engram tables in host memory (memory-mapped from the checkpoint) and
    gathers each step's rows with a host callback — what the real ~100 GB tables need (SPEC §9.7).
    ``mesh`` (a spec such as ``"dep=8"`` or a Mesh) places params, state and batches with the ``strategy``
    rule table of ``dsflash.sharding`` and runs the routed experts expert-parallel; rows are padded to a
    multiple of the DP size.
    ``backend`` ("auto": Triton kernels on a GPU with jax-triton, XLA otherwise; "xla"; "triton") becomes
    ``Model.opts.backend``; which kernel runs where is ``dsflash.kernels.dispatch``'s decision.
    ``cfg_overrides`` replace config fields of a preset (e.g. ``num_hidden_layers=4``)."""
    if engram_tables not in ("device", "host"):
        raise ValueError(f"engram_tables must be 'device' or 'host', got {engram_tables!r}")
    path = os.fspath(model)
    if path in SHIPPED and not os.path.isfile(os.path.join(path, "config.json")):
        path = SHIPPED[path]            # a local checkpoint folder of the same name still wins
    mesh = _mesh(mesh)
    tokenizer = None
    host_tables = None
    if os.path.isdir(path):
        from dsflash.checkpoint import load_checkpoint
        from dsflash.config import ModelConfig as _C
        shardings = _shardings(_C.load_json(path), mesh, strategy, engram_tables) if mesh is not None else None
        cfg, params = load_checkpoint(path, progress=progress, host_tables=engram_tables, shardings=shardings)
        if cfg_overrides:
            raise ValueError("load(): config overrides apply to presets only")
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            from dsflash.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_folder(path)
        name = os.path.basename(os.path.normpath(path))      # "demo" for the shipped model too
    elif path in PRESETS:
        cfg = preset(path).replace(**cfg_overrides) if cfg_overrides else preset(path)
        # tensor by tensor onto the devices (the real model's ~300 GB never sits on the host at once)
        params, host_tables = init_params_placed(
            cfg, seed, _shardings(cfg, mesh, strategy, engram_tables) if mesh is not None else None,
            host_tables=engram_tables == "host", progress=progress and cfg.num_hidden_layers > 8)
        tokenizer = _synthetic_tokenizer(cfg)
        name = path
    else:
        raise ValueError(f"model: {path!r} is neither a checkpoint folder, a shipped model ({', '.join(SHIPPED)}) "
                         f"nor a preset ({', '.join(PRESETS)})")
    if engram_tables == "host":
        if host_tables is None:             # a checkpoint: its tables are (memory-mapped) entries of params
            params = dict(params)
            host_tables = {}
            for layer in cfg.engram_layer_ids:
                w = params.pop(f"layers.{layer}.engram.embed.weight")
                sc = params.pop(f"layers.{layer}.engram.embed.scale")
                host_tables[layer] = (np.asarray(w), np.asarray(sc))      # memmaps stay memmaps
        from dsflash.model.engram import register_host_tables
        register_host_tables(cfg, host_tables)
    tail = replay_tail if replay_tail is not None else cfg.sliding_window + cfg.dspark_block_size
    opts = RunOptions(precision=precision, bounded_replay=bounded_replay, replay_tail=tail if bounded_replay else 0,
                      backend=backend, page_size=page_size)
    return Model(cfg, params, tokenizer, opts, name, mesh=mesh, strategy=strategy)


def _mesh(mesh):
    if mesh is None or not isinstance(mesh, str):
        return mesh
    from dsflash.sharding.mesh import make_mesh
    return make_mesh(mesh)


def _shardings(cfg, mesh, strategy, engram_tables):
    from dsflash.sharding.rules import param_shardings
    return param_shardings(cfg, mesh, strategy, include_host=engram_tables == "device")


def _synthetic_tokenizer(cfg: ModelConfig):
    """Presets with a small vocabulary get the deterministic synthetic tokenizer (for text in/out)."""
    if cfg.vocab_size > 4096:
        return None
    from dsflash.tokenizer import Tokenizer, write_synthetic_tokenizer
    with tempfile.TemporaryDirectory() as d:
        write_synthetic_tokenizer(d, cfg)
        return Tokenizer.from_folder(d)
