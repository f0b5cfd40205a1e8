"""``python -m dsflash.bench forward``: exact per-iteration forward step times on the current mesh.

What it measures (DESIGN §8, SERVING §10 item 5; method in docs/benchmarks.md "bench forward"):

* **prefill** ``--prefill N@C``: one forward of N new tokens per sequence over C cached tokens;
* **decode** ``--decode B@C``: one forward of B sequences *per DP rank*, each at context C, with
  ``--draft-rows`` rows per sequence (1 + DSpark block = target verification of a drafted block;
  ``--draft-rows 1`` is plain decode). A point spec is ``Bs@Cs`` with comma lists (cartesian
  product); several specs are separated by ``;`` or given as separate arguments.

The C cached tokens never come from a prefill: the state is **dummy-filled** (random packed bytes in
every page pool, window ring, compressor ring and Engram history; finite codes only) and every row's
page table points at its own pages, so a 128K-context decode costs one fill, not a 128K prefill.

Per point it reports (compile excluded: ``jit(...).lower().compile()`` first, then ``--warmup`` calls,
then the median / min / p90 of ``--reps`` calls, each ended by ``block_until_ready`` on logits and state;
the state is donated and the returned state fed back, so every call rewrites the same rows):

* ``step_ms`` with the model's own router ("real" routing), tokens/s;
* ``draft_ms`` (decode, ``--no-draft`` skips): the DSpark half of a speculative step on the same state,
  ``update_context`` with the verified rows' taps (random, as if from the target) + ``propose`` of the next
  block; ``spec_step_ms`` = step + draft;
* ``uniform_ms``: the same step with a uniform random router (top-k distinct ids per token from a fixed
  key); ``zipf_ms`` (``--zipf A``): a skewed random router (top-k distinct ids per token with expert
  probabilities ~ 1 / rank^A over a fixed random ranking of the experts: hot experts land on random EP ranks);
  and ``balancedness`` of each: per-layer expert loads recorded by routing this step's tokens,
  balancedness = Σ_layers mean rank load / Σ_layers max rank load for the mesh's EP placement
  (experts contiguous per EP rank; on a single device ``--balance-ranks`` hypothetical ranks);
* ``roofline``: the whole-step floor on one device (``bench.step_floor``: the bytes the step must move -- weights it
  uses, routed experts hit, the window + selected compressed entries + index keys it reads, never the embedding
  table -- over the streaming-read bandwidth, flops over the bf16 / FP8 GEMM rates, all measured at the start of the
  run by ``bench.ceilings``), per op and in total; ``draft_floor`` for the DSpark half;
* ``profile`` (``--profile``): the per-op table, kernel time per model op from a jax.profiler trace of the same
  compiled step next to each op's floor (GPU; on CPU the floors alone);
* logits (``--logits``, default auto): every row at decode ([B, S, V], what the engine's verification reads), the
  last row at prefill;
* ``breakdown`` (``--breakdown``, default on): attention = full − (attention replaced by zeros: no
  projections, indexer, KV/ring writes), moe = full − (the whole MoE block replaced by zeros: gate, shared
  and routed experts), routed = full − (routed experts replaced by zeros: routing top-k, EP dispatch /
  combine, grouped GEMM), other = the program with both attention and MoE replaced (embedding, mHC,
  norms, head), interaction = full − attention − moe − other (what the differences do not add up to).
  Attention / MoE are differences of separately compiled programs, so fusion changes and overlap make
  them approximate;
* DP imbalance (meshes with more than one DP rank):
  ``--mirror``: the decode point with unequal per-rank contexts (rank r at
  ``C·(1 − F + 2F·r/(N−1))``, ``--dp-imbalance F``) run as is, and "mirrored": every rank given rank r's
  work, for a few ranks r. A mirrored run is the step rank r would take if every rank looked like it
  (its per-rank forward time in a balanced system); as-is / mean(mirrored) − 1 prices the imbalance.
  ``--lag SECONDS``: rank r starts its step r·SECONDS late. Emulated on one host inside the SPMD program:
  before the embedding, each DP rank runs a calibrated on-device busy loop of r·SECONDS that its token
  ids depend on, so rank r's work starts that much later while the others proceed until they block in the
  first collective (the EP all-gather / all-to-all of layer 0's MoE). Reported: step with lag, the
  stagger (N−1)·SECONDS, exposed = step_lag − step, absorbed = stagger − exposed (the part of the
  stagger hidden behind rank-local work).

Output: a table on stdout, ``benchmarks/results/forward_<date>_<device>.json`` (``--out DIR``) with
date, commit, device, config hash, mesh, method, and a PNG next to it (matplotlib optional).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import time
import warnings

import numpy as np

from dsflash import compile_options
from dsflash.bench.kernels import _commit
from dsflash.kernels.dispatch import BACKENDS, describe, kernel_summary, resolve_backend

# cheaper CPU codegen for tests (--fast-compile); never used for reported GPU numbers
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ------------------------------------------------------------------------------------------ parsing
def parse_points(specs) -> list[tuple[int, int]]:
    """``["1,8@128,1024", "4@64"]`` -> [(1,128), (1,1024), (8,128), (8,1024), (4,64)]."""
    if isinstance(specs, str):
        specs = [specs]
    out = []
    for spec in specs or []:
        for term in spec.replace(" ", ";").split(";"):
            if not term:
                continue
            if "@" not in term:
                raise ValueError(f"point {term!r}: expected 'N@C' (e.g. 8@4096 or 1,8,32@1024,8192)")
            a, c = term.split("@", 1)
            try:
                xs = [int(v) for v in a.split(",") if v]
                cs = [int(v) for v in c.split(",") if v]
            except ValueError:
                raise ValueError(f"point {term!r}: sizes must be integers") from None
            if not xs or not cs or min(xs) < 1 or min(cs) < 0:
                raise ValueError(f"point {term!r}: need count >= 1 and context >= 0")
            out += [(x, cc) for x in xs for cc in cs]
    return out


def _stats(ts):
    ts = np.asarray(ts, np.float64) * 1e3
    return {"median": float(np.median(ts)), "min": float(ts.min()), "p90": float(np.percentile(ts, 90)),
            "max": float(ts.max()), "n": int(ts.size)}


def load_config(name):
    """A preset name (dsflash.config.PRESETS) or a path to a config.json (official nested or flat)."""
    from dsflash.config import ModelConfig, preset
    if name.endswith(".json") or os.path.isdir(name):
        return ModelConfig.load_json(name)
    return preset(name)


# ------------------------------------------------------------------------------------------ synthetic routers
def random_router(key, T: int, E: int, k: int, alpha: float = 0.0):
    """``[T, k]`` distinct expert ids per token: uniform (``alpha`` 0) or skewed, expert ``e`` drawn with
    probability ~ ``rank_e ** -alpha`` over a fixed random ranking (so the hot experts sit on random EP ranks);
    k draws without replacement by Gumbel top-k."""
    import jax
    import jax.numpy as jnp
    rank = np.random.default_rng(99).permutation(E) + 1
    logp = jnp.asarray(-alpha * np.log(rank), jnp.float32)
    _, idx = jax.lax.top_k(logp[None, :] + jax.random.gumbel(key, (T, E)), k)
    return idx.astype(jnp.int32)


# ------------------------------------------------------------------------------------------ state fill
def dummy_fill(abstract_state, cfg, key):
    """Random *finite* contents for every state leaf (jit-able; shapes/dtypes of ``abstract_state``).

    Packed nibbles (E2M1 main KV / index K) are random bytes (every code is finite); UE8M0 scales are
    exponents 2^-9..2^0; E4M3 window codes ~N(0, 1); E4M3 main-KV group scales in [0.01, 0.3]; float
    leaves ~N(0, 0.5); the Engram history holds random compressed ids."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys):
        names = [getattr(p, "key", str(p)) for p in path]
        last, top = names[-1], names[0]
        shape, dt = leaf.shape, jnp.dtype(leaf.dtype)
        if top == "engram_hist":
            v = jax.random.randint(k, shape, 0, max(1, cfg.engram_compressed_vocab_size), jnp.int32)
        elif dt == jnp.uint8 and last == "q":
            v = jax.random.bits(k, shape, jnp.uint8)
        elif dt == jnp.uint8:
            v = jax.random.randint(k, shape, 118, 128, jnp.int32).astype(jnp.uint8)
        elif dt == jnp.dtype(jnp.float8_e4m3fn) and last == "s":
            v = jax.random.uniform(k, shape, jnp.float32, 0.01, 0.3).astype(dt)
        elif dt == jnp.dtype(jnp.float8_e4m3fn):
            v = jnp.clip(jax.random.normal(k, shape, jnp.float32), -4, 4).astype(dt)
        elif jnp.issubdtype(dt, jnp.floating):
            v = (0.5 * jax.random.normal(k, shape, jnp.float32)).astype(dt)
        else:
            v = jnp.zeros(shape, dt)
        out.append(v)
    return jax.tree_util.tree_unflatten(treedef, out)


# ------------------------------------------------------------------------------------------ the bench
class ForwardBench:
    """Everything one ``bench forward`` run shares: config, mesh, placed params, compiled steps."""

    def __init__(self, args):
        import jax

        from dsflash.model.params import init_params_placed
        from dsflash.sharding import rules
        from dsflash.sharding.mesh import mesh_sizes, parse_spec

        self.args = args
        self.cfg = cfg = load_config(args.preset)
        self.page = args.page_size
        self.mesh = None
        self.strategy = None
        self.n_dp = 1
        self.n_ep = 1
        t0 = time.perf_counter()
        host = getattr(args, "engram_tables", "device") == "host"
        shardings = None
        if args.mesh:
            from dsflash.sharding.mesh import make_mesh
            sizes = parse_spec(args.mesh)
            n = int(np.prod(list(sizes.values())))
            if n > len(jax.devices()):
                raise SystemExit(f"--mesh {args.mesh} needs {n} devices, jax sees {len(jax.devices())}")
            self.mesh = make_mesh(args.mesh, jax.devices()[:n])
            dx = cfg.dspark_n_routed_experts if cfg.n_stages else 0
            self.strategy = rules.get_strategy("dep", draft_expert_parallel=bool(dx) and dx % n == 0)
            self.n_dp = int(np.prod([mesh_sizes(self.mesh)[a] for a in rules.token_axes(self.mesh, self.strategy)]))
            self.n_ep = int(np.prod([mesh_sizes(self.mesh)[a] for a in rules.expert_axes(self.mesh, self.strategy)]))
            shardings = rules.param_shardings(cfg, self.mesh, self.strategy, include_host=not host)
        # drawn and placed tensor by tensor: at real size the host never holds the whole model
        self.params, tables = init_params_placed(cfg, args.seed, shardings, device=jax.devices()[0], host_tables=host,
                                                 progress=cfg.num_hidden_layers > 8,
                                                 on_device=getattr(args, "init", "numpy") == "device")
        if host:
            from dsflash.model.engram import register_host_tables
            register_host_tables(cfg, tables)
        self.host_table_bytes = sum(w.nbytes + sc.nbytes for w, sc in tables.values())
        self.init_s = time.perf_counter() - t0          # draw + place, one tensor at a time
        self.balance_ranks = self.n_ep if self.n_ep > 1 else args.balance_ranks
        # the numerics option per program (dsflash.compile_options), plus --fast-compile's
        self.compile_opts = compile_options.options(FAST_COMPILE if args.fast_compile else None)
        self._lag_rate = None
        self.ceilings = None            # dsflash.bench.ceilings.measure() of this run (set by main)
        self._compiled = {}
        self._last_compile_s = 0.0

    # ---------------------------------------------------------------- shapes
    def geometry(self, rows_total, S, ctx_max):
        from dsflash.model.state import CacheGeometry
        pages = max(1, -(-(ctx_max + S) // self.page))
        return CacheGeometry(num_slots=rows_total, num_pages=rows_total * pages, page_size=self.page,
                             ring_slack=max(16, S if S <= 64 else 16)), pages

    def make_inputs(self, S, contexts, seed=0):
        """Batch + dummy-filled state: one row per entry of ``contexts`` (the global row order: rank r's
        rows are r*B .. r*B+B-1, with rank-local slots and pages)."""
        import jax

        from dsflash.model.state import init_state, make_batch
        from dsflash.sharding import rules

        rows = len(contexts)
        geo, pages = self.geometry(rows, S, max(contexts))
        abstract = jax.eval_shape(lambda: init_state(self.cfg, geo, self.args.precision))
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, self.cfg.vocab_size, (rows, S)).astype(np.int32)
        batch = make_batch(tokens, start=np.asarray(contexts, np.int32), pages_per_seq=pages)
        if self.mesh is not None:
            st_sh = rules.state_shardings(abstract, self.mesh, self.strategy)
            batch = jax.device_put(batch, rules.batch_shardings(batch, self.mesh, self.strategy))
        else:
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            st_sh = jax.tree.map(lambda _: dev, abstract)
            batch = jax.device_put(batch, jax.devices()[0])
        fill = jax.jit(lambda k: dummy_fill(abstract, self.cfg, k), out_shardings=st_sh)
        state = fill(jax.random.PRNGKey(seed + 1))
        jax.block_until_ready(state)
        return batch, state

    # ---------------------------------------------------------------- steps
    def routed_base(self, phase, tables=None):
        """The EP hook of this phase; ``tables`` (traced ``(log2phy [L, E, R], logcnt [L, E])``): EPLB, logical
        ids mapped to the physical replicas of each layer."""
        if self.mesh is None:
            return None
        from dsflash.sharding.ep_moe import EPSettings, make_routed_fn
        mode = "prefill" if phase == "prefill" else self.args.ep_decode_mode
        kw = {}
        if tables is not None:
            names = [f"layers.{l}" for l in range(self.cfg.num_hidden_layers)]
            kw = dict(log2phy={n: tables[0][l] for l, n in enumerate(names)},
                      logcnt={n: tables[1][l] for l, n in enumerate(names)})
        return make_routed_fn(self.mesh, EPSettings(self.args.ep_collective, mode,
                                                    capacity_factor=self.args.capacity_factor), **kw)

    def step_fn(self, variant, phase, lag_iters=0):
        """A pure step ``(params, batch, state) -> (logits, state, loads [L, E])`` for one variant:
        full | uniform | zipf | eplb | zipf_eplb | no_attn | no_moe | no_both | no_routed | lag (``*eplb``:
        physical experts + the tables ``eplb.log2phy`` / ``eplb.logcnt`` carried in params, as jit arguments)."""
        import jax
        import jax.numpy as jnp

        from dsflash.kernels import moe_gemm
        import importlib
        F = importlib.import_module("dsflash.model.forward")
        from dsflash.model.state import RunOptions

        cfg = self.cfg
        opts = RunOptions(precision=self.args.precision, backend=self.args.backend, page_size=self.page,
                          logits=self.logits_for(phase))
        E = cfg.n_routed_experts

        def step(params, batch, state):
            rec = []
            valid = batch.valid.reshape(-1)
            tables = (params["eplb.log2phy"], params["eplb.logcnt"]) if variant.endswith("eplb") else None
            base = self.routed_base(phase, tables) or moe_gemm.routed_moe

            def hook(x, idx, w, *ws, **kw):
                if variant in ("uniform", "zipf", "zipf_eplb"):
                    key = jax.random.fold_in(jax.random.PRNGKey(1234), len(rec))
                    idx = random_router(key, x.shape[0], E, idx.shape[1],
                                        getattr(self.args, "zipf", 0.0) if variant.startswith("zipf") else 0.0)
                if variant not in ("no_moe", "no_both"):
                    rec.append(jnp.zeros((E,), jnp.int32).at[idx].add(
                        jnp.broadcast_to(valid[:, None], idx.shape).astype(jnp.int32)))
                if variant == "no_routed":
                    return jnp.zeros(x.shape, jnp.float32)
                return base(x, idx, w, *ws, **kw)

            if variant == "lag" and lag_iters:
                batch = dataclasses.replace(batch, tokens=self._delay(batch.tokens, lag_iters))
            with _patched(F, variant):
                out, new_state = F.forward(params, cfg, batch, state, opts, routed_fn=hook)
            loads = jnp.stack(rec) if rec else jnp.zeros((0, E), jnp.int32)
            return out["logits"], new_state, loads

        return step

    def compile(self, fn, *args):
        import jax
        t0 = time.perf_counter()
        c = jax.jit(fn, donate_argnums=(2,)).lower(*args).compile(compiler_options=self.compile_opts)
        self._last_compile_s = time.perf_counter() - t0
        return c, self._last_compile_s

    def time_step(self, compiled, params, batch, state):
        """(stats in ms, final state, loads of the last call)."""
        import jax
        for _ in range(self.args.warmup):
            logits, state, loads = compiled(params, batch, state)
            jax.block_until_ready((logits, state))
        ts, enq = [], []
        for _ in range(self.args.reps):
            t0 = time.perf_counter()
            logits, state, loads = compiled(params, batch, state)
            enq.append(time.perf_counter() - t0)      # the host's part: the call returns once its launches are queued
            jax.block_until_ready((logits, state))
            ts.append(time.perf_counter() - t0)
        # back to back, one wait at the end: the host queues call i+1 while the device runs call i (as a serving loop
        # that does not wait on each step), so this is the device-bound step where the host keeps up
        t0 = time.perf_counter()
        for _ in range(self.args.reps):
            logits, state, loads = compiled(params, batch, state)
        jax.block_until_ready((logits, state))
        pipelined = (time.perf_counter() - t0) / max(self.args.reps, 1)
        finite = bool(np.isfinite(np.asarray(jax.device_get(logits), np.float32)).all())
        stats = _stats(ts)
        stats["enqueue_median"] = float(np.median(enq) * 1e3)
        stats["pipelined_mean"] = float(pipelined * 1e3)
        return stats, state, np.asarray(jax.device_get(loads)), finite

    def logits_for(self, phase):
        """``--logits``; auto: every row at decode (the engine's verification reads [B, S, V]), the last row at
        prefill (as the engine's prefill)."""
        lg = getattr(self.args, "logits", "auto")
        return lg if lg != "auto" else ("all" if phase == "decode" else "last")

    def run_variant(self, variant, phase, batch, state, lag_iters=0, params=None, scoped=False):
        """Compile (or reuse: same variant and input shapes/shardings give the same program) and time;
        ``params``: other weights of the same shapes per variant (the EPLB variants' physical experts);
        ``scoped``: trace and compile under ``step_profile.scoped_model()`` (named op scopes in the HLO metadata,
        for ``--profile``; the same program otherwise). The executable stays in ``self._compiled[key]``."""
        import jax
        params = self.params if params is None else params
        key = str((variant, phase, lag_iters, scoped, jax.tree.map(
            lambda a: (a.shape, str(a.dtype), str(a.sharding)), (batch, state))))
        self._last_key = key
        hit = key in self._compiled
        if not hit:
            from dsflash.bench import step_profile
            with step_profile.scoped_model() if scoped else contextlib.nullcontext():
                self._compiled[key] = self.compile(self.step_fn(variant, phase, lag_iters), params, batch, state)[0]
            cs = self._last_compile_s
        stats, state, loads, finite = self.time_step(self._compiled[key], params, batch, state)
        stats["compile_s"] = 0.0 if hit else round(cs, 3)
        stats["compiled_program_reused"] = hit
        return stats, state, loads, finite

    # ---------------------------------------------------------------- DSpark draft
    def run_draft(self, batch, state):
        """Time the DSpark half of a speculative step on the decode point's state: ``update_context`` with the
        taps of the verified rows (random, as if from the target forward) + ``propose`` of the next block."""
        import importlib
        import inspect

        import jax
        import jax.numpy as jnp

        from dsflash.model.state import RunOptions
        D = importlib.import_module("dsflash.model.dspark")
        cfg = self.cfg
        opts = RunOptions(precision=self.args.precision, backend=self.args.backend, page_size=self.page)
        kw = {}
        if self.mesh is not None and self.strategy.draft_expert_parallel and \
                "routed_fn" in inspect.signature(D.propose).parameters:
            from dsflash.sharding.ep_moe import EPSettings, make_routed_fn
            kw["routed_fn"] = make_routed_fn(self.mesh, EPSettings(self.args.ep_collective, self.args.ep_decode_mode,
                                                                   capacity_factor=self.args.capacity_factor))

        def fn(params, batch, state, taps):
            state = D.update_context(params, cfg, taps, batch.start, batch.lengths, batch.slots, state, opts)
            out = D.propose(params, cfg, state, batch.tokens[:, -1], batch.start + batch.lengths, batch.slots, opts,
                            **kw)
            return out["drafts"], state

        rows, S = batch.tokens.shape
        T = len(cfg.dspark_target_layer_ids) * cfg.hidden_size
        taps = jax.random.normal(jax.random.PRNGKey(7), (rows, S, T), jnp.float32).astype(jnp.bfloat16)
        if self.mesh is not None:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            from dsflash.sharding import rules
            ax = rules.token_axes(self.mesh, self.strategy)
            taps = jax.device_put(taps, NamedSharding(self.mesh, P(ax if len(ax) != 1 else ax[0])))
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=(2,)).lower(self.params, batch, state, taps).compile(
            compiler_options=self.compile_opts)
        cs = time.perf_counter() - t0
        for _ in range(self.args.warmup):
            d, state = compiled(self.params, batch, state, taps)
            jax.block_until_ready((d, state))
        ts = []
        for _ in range(self.args.reps):
            t0 = time.perf_counter()
            d, state = compiled(self.params, batch, state, taps)
            jax.block_until_ready((d, state))
            ts.append(time.perf_counter() - t0)
        st = _stats(ts)
        st["compile_s"] = round(cs, 3)
        st["block"] = cfg.dspark_block_size
        return st, state

    # ---------------------------------------------------------------- lag emulation
    def _delay(self, tokens, iters_per_rank):
        """tokens [rows, S] sharded over the DP axes -> the same values, after rank r spun r*iters loop
        iterations on its own device (a data dependency of its rows, so its step starts that much later)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        from dsflash.sharding import rules
        from dsflash.sharding.mesh import mesh_sizes

        tok_axes = rules.token_axes(self.mesh, self.strategy)
        sizes = mesh_sizes(self.mesh)

        def body(t):
            r = jnp.int32(0)
            for a in tok_axes:
                r = r * sizes[a] + jax.lax.axis_index(a)
            s = _spin(r * iters_per_rank)
            return t + (s < -1.0).astype(t.dtype)       # s > 0 always; the compiler cannot know

        spec = P(tok_axes if len(tok_axes) != 1 else tok_axes[0])
        return jax.shard_map(body, mesh=self.mesh, in_specs=(spec,), out_specs=spec)(tokens)

    def spin_only_ms(self, batch, iters):
        """The stagger alone on the mesh (should be close to (N-1)*lag: checks the calibration)."""
        import jax
        f = jax.jit(lambda t: self._delay(t, iters))
        jax.block_until_ready(f(batch.tokens))
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(f(batch.tokens))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3

    def lag_rate(self):
        """Busy-loop iterations per second on one device: grow n until one call takes >= 50 ms, then the
        slope between n/10 and n (launch overhead cancels)."""
        if self._lag_rate is None:
            import jax
            import jax.numpy as jnp
            f = jax.jit(_spin)

            def t(n):
                jax.block_until_ready(f(jnp.int32(n)))
                reps = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(jnp.int32(n)))
                    reps.append(time.perf_counter() - t0)
                return float(np.median(reps))

            n = 1000
            while t(n) < 0.05 and n < 1 << 30:
                n *= 4
            self._lag_rate = (n - n // 10) / max(t(n) - t(n // 10), 1e-9)
        return self._lag_rate

    # ---------------------------------------------------------------- points
    def memory(self, state) -> dict:
        """Per-device bytes of the placed params and of this point's state (the shards each device holds; the
        largest device), and the allocator's peak where the platform reports it (GPU)."""
        import jax

        def per_device(tree):
            out = {}
            for a in jax.tree_util.tree_leaves(tree):
                for sh in getattr(a, "addressable_shards", ()):
                    out[sh.device.id] = out.get(sh.device.id, 0) + sh.data.nbytes
            return out
        p, st = per_device(self.params), per_device(state)
        devs = sorted(set(p) | set(st))
        rec = {"params": max(p.get(d, 0) for d in devs), "state": max(st.get(d, 0) for d in devs)}
        peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()
                 if hasattr(d, "memory_stats")]
        if peaks and all(isinstance(x, int) for x in peaks):
            rec["peak_in_use"] = max(peaks)
        return rec

    def roofline(self, phase, rows, S, C, loads, mem, step_ms) -> dict:
        """The whole-step floor of this step on one device (``step_floor``: bytes the step really moves -- weights
        it uses, routed experts that were hit, the KV the sparse attention reads, never the embedding table --
        over the read bandwidth measured in this run, flops at the measured GEMM rates), per op and in total.
        ``old_definition``: the bytes of the earlier roofline (all dense weights incl. the embedding table + the
        touched experts + the whole state), for comparing with older results."""
        from dsflash.bench import step_floor
        f = step_floor.step_floor(self.cfg, rows, S, C, self.args.precision, loads if loads.size else None,
                                  ceilings=self.ceilings, logits=self.logits_for(phase), ep_ranks=self.n_ep,
                                  ring_slack=self.geometry(1, S, C)[0].ring_slack)
        t = f["total"]
        out = {"definition": "step_floor: bytes / measured read bandwidth vs flops / measured GEMM rates",
               "bytes": t["bytes"], "weight_bytes": t["weight_bytes"], "cache_bytes": t["cache_bytes"],
               "act_bytes": t["act_bytes"], "flops": t["flops"], "flops_fp8": t["flops_fp8"],
               "flops_bf16": t["flops_bf16"], "rates": f["rates"], "notes": f["notes"], "ops": f["ops"], "total": t}
        if t.get("floor_ms") is not None:
            out.update(bytes_ms=t["bytes_ms"], flops_ms=t["flops_ms"], roofline_ms=t["floor_ms"],
                       sum_op_floors_ms=t["sum_op_floors_ms"], frac_of_roofline=t["floor_ms"] / step_ms,
                       exact_floor_ms=t["exact_floor_ms"], frac_of_exact_floor=t["exact_floor_ms"] / step_ms)
        out["old_definition"] = self._old_roofline_bytes(loads, mem)
        return out

    def _old_roofline_bytes(self, loads, mem) -> dict:
        """The earlier accounting (kept only to compare with older results; it overstates the bytes)."""
        if getattr(self, "_weight_bytes", None) is None:     # the placed weights do not change: count once
            per = {}
            for k, a in self.params.items():
                if k.startswith("mtp."):
                    continue
                kind = "experts" if ".ffn.experts." in k else "dense"
                for sh in a.addressable_shards:
                    d = per.setdefault(sh.device.id, {"experts": 0, "dense": 0})
                    d[kind] += sh.data.nbytes
            self._weight_bytes = (max(v["dense"] for v in per.values()), max(v["experts"] for v in per.values()))
        dense, experts = self._weight_bytes
        touched = 1.0
        if loads.size:
            L, E = loads.shape
            R = self.n_ep
            touched = float(((loads > 0).reshape(L, R, E // R).sum(axis=(0, 2)) / (L * E // R)).max())
        return {"bytes": int(dense + experts * touched + mem["state"]), "dense_bytes_incl_embedding": int(dense),
                "expert_bytes_touched": int(experts * touched), "state_bytes": int(mem["state"]),
                "note": "all dense weights incl. the embedding table + touched experts + the whole state; was "
                        "divided by a v*2 copy bandwidth on 1 GiB (both overstated the fraction of roofline)"}

    def profile(self, phase, batch, state, floor, log, extra=None, step_ms=None):
        """``--profile``: the per-op table of the compiled (scoped) full step: kernel time per op from a
        jax.profiler trace (``step_profile``), next to each op's floor. On a platform without GPU kernels the
        profile is empty: a note, and the floors alone."""
        import jax

        from dsflash.bench import step_floor, step_profile
        compiled = self._compiled[self._last_key]
        box = {"state": state}

        def once():
            lg, box["state"], _ = compiled(self.params, batch, box["state"])
            jax.block_until_ready((lg, box["state"]))

        out = {}
        try:
            prof = step_profile.profile_step(once, compiled.as_text(), calls=self.args.profile_calls)
        except Exception as e:  # noqa: BLE001 - a failed trace must not lose the point
            prof = None
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if prof is not None and not prof["ops"]:
            out["note"] = (f"no GPU kernels in the trace ({jax.devices()[0].platform}): per-op times need a GPU; "
                           "the floors are shown alone")
            prof = None
        out["profile"] = prof
        out["op_table"] = step_floor.op_table(prof, floor, extra)
        log(step_floor.format_table(out["op_table"], prof, floor, step_ms))
        for k in ("note", "error"):
            if k in out:
                log(f"    profile {k}: {out[k]}")
        return out, box["state"]

    def run_eplb(self, phase, batch, state, logical_loads, variant):
        """EPLB on: DeepSeek's policy on this step's logical loads ``[L, E]`` with ``--eplb R`` redundant slots,
        the routed experts re-laid out physically (``[E + R, ...]``, same sharding), the step timed again with
        the same router. Needs room for a second copy of the routed experts on each device."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from dsflash.sharding.eplb import balancedness, expand_to_physical, physical_load, rebalance_experts
        cfg, R = self.cfg, self.args.eplb
        L, E = logical_loads.shape
        if L != cfg.num_hidden_layers:
            raise ValueError(f"--eplb: recorded {L} MoE layers, the config has {cfg.num_hidden_layers}")
        phy2log, log2phy, logcnt = rebalance_experts(logical_loads.astype(np.float64), E + R, 1, 1, self.n_ep)
        params = expand_to_physical(self.params, phy2log, L)       # each expert array keeps its EP sharding
        rep = NamedSharding(self.mesh, PartitionSpec())
        params["eplb.log2phy"] = jax.device_put(np.asarray(log2phy, np.int32), rep)
        params["eplb.logcnt"] = jax.device_put(np.asarray(logcnt, np.int32), rep)
        st, state, _, finite = self.run_variant(variant, phase, batch, state, params=params)
        del params
        return {"redundant": R, "router": variant.replace("_eplb", "") if variant != "eplb" else "real",
                "step_ms": st, "finite_logits": finite,
                "balancedness_before": round(balancedness(logical_loads, self.n_ep), 4),
                "balancedness_after_predicted": round(balancedness(
                    physical_load(logical_loads, phy2log, logcnt), self.n_ep), 4)}, state

    def draft_floor(self, rows, S, C) -> dict:
        """The DSpark half's floor (``step_floor.draft_floor``; the draft's expert loads are not recorded: uniform
        routing's expected hit experts)."""
        from dsflash.bench import step_floor
        return step_floor.draft_floor(self.cfg, rows, S, C, self.args.precision, ceilings=self.ceilings,
                                      ep_ranks=self.n_ep if self.strategy is not None and
                                      self.strategy.draft_expert_parallel else 1)

    def balancedness(self, loads):
        from dsflash.sharding.eplb import balancedness
        R = self.balance_ranks
        if loads.size == 0 or loads.shape[1] % R:
            return None
        return round(balancedness(loads, R), 4)

    def point(self, phase, n, C, log):
        args = self.args
        if phase == "decode":
            S, per_rank = args.draft_rows, n
        else:
            S, per_rank = n, 1
        rows = per_rank * self.n_dp
        rec = {"phase": phase, "C": C, "S": S, "rows_per_rank": per_rank, "rows": rows, "tokens": rows * S,
               "tokens_per_rank": per_rank * S}
        if phase == "decode":
            rec.update(B=n, draft_rows=S)
        else:
            rec.update(N=n)
        batch, state = self.make_inputs(S, [C] * rows)
        profile = getattr(args, "profile", False)
        stats, state, loads, finite = self.run_variant("full", phase, batch, state, scoped=profile)
        full_key = self._last_key
        rec["logits"] = self.logits_for(phase)
        rec["memory_per_device_bytes"] = self.memory(state)
        rec["step_ms"] = stats
        rec["roofline"] = self.roofline(phase, per_rank, S, C, loads, rec["memory_per_device_bytes"],
                                        stats["median"])
        rec["finite_logits"] = finite
        rec["tok_per_s"] = rows * S / (stats["median"] * 1e-3)
        rec["tok_per_s_per_rank"] = rec["tok_per_s"] / self.n_dp
        rec["balancedness"] = {"ranks": self.balance_ranks, "real": self.balancedness(loads),
                               "routed_tokens": int(loads.sum() // max(1, self.cfg.num_experts_per_tok)
                                                    // max(1, loads.shape[0])) if loads.size else 0}
        log(f"  {phase} {n}@{C}: full {stats['median']:.3f} ms (compile {stats['compile_s']:.1f} s)")
        if args.uniform:
            st, state, ul, _ = self.run_variant("uniform", phase, batch, state)
            rec["uniform_ms"] = st
            rec["balancedness"]["uniform"] = self.balancedness(ul)
            rec["real_over_uniform"] = stats["median"] / st["median"]
        if getattr(args, "zipf", 0.0):
            st, state, zl, _ = self.run_variant("zipf", phase, batch, state)
            rec["zipf_ms"] = st
            rec["balancedness"]["zipf"] = self.balancedness(zl)
            rec["zipf_alpha"] = args.zipf
        if getattr(args, "eplb", None) is not None:
            rec["eplb"], state = self.run_eplb(phase, batch, state, zl if getattr(args, "zipf", 0.0) else loads,
                                               "zipf_eplb" if getattr(args, "zipf", 0.0) else "eplb")
        if phase == "decode" and args.draft and self.cfg.n_stages:
            rec["draft_ms"], state = self.run_draft(batch, state)
            rec["spec_step_ms"] = stats["median"] + rec["draft_ms"]["median"]
            log(f"    draft (update_context + propose {self.cfg.dspark_block_size}): {rec['draft_ms']['median']:.3f} ms")
            rec["draft_floor"] = self.draft_floor(per_rank, S, C)
            if rec["draft_floor"]["total"].get("floor_ms") is not None:
                rec["spec_step_floor_ms"] = rec["roofline"].get("roofline_ms", 0) + rec["draft_floor"]["total"]["floor_ms"]
        if profile:
            self._last_key = full_key
            extra = {"draft": (rec["draft_ms"]["median"], rec["draft_floor"]["total"])} if "draft_floor" in rec else None
            rec["profile"], state = self.profile(phase, batch, state, rec["roofline"], log, extra, stats["median"])
        if args.breakdown:
            v = {}
            for var in ("no_attn", "no_moe", "no_routed", "no_both"):
                st, state, _, _ = self.run_variant(var, phase, batch, state)
                v[var] = st
            full = stats["median"]
            attn = full - v["no_attn"]["median"]
            moe = full - v["no_moe"]["median"]
            rec["variants_ms"] = v
            rec["breakdown_ms"] = {"attention": attn, "moe": moe, "routed": full - v["no_routed"]["median"],
                                   "shared_and_gate": moe - (full - v["no_routed"]["median"]),
                                   "other": v["no_both"]["median"],
                                   "interaction": full - attn - moe - v["no_both"]["median"]}
        if phase == "decode" and self.n_dp > 1 and args.mirror:
            rec["mirror"] = self.mirror(n, C, S, stats, log)
        if self.n_dp > 1 and args.lag:
            rec["lag"] = self.lag(phase, batch, state, stats, log)
        return rec

    def mirror(self, B, C, S, base_stats, log):
        N, F = self.n_dp, self.args.dp_imbalance
        ctx = [int(round(C * (1 - F + 2 * F * r / (N - 1)))) for r in range(N)]
        contexts = [c for c in ctx for _ in range(B)]
        batch, state = self.make_inputs(S, contexts, seed=3)
        asis, _, _, _ = self.run_variant("full", "decode", batch, state)
        del state
        ranks = sorted(set([0, N // 3, (2 * N) // 3, N - 1])) if N > 4 else list(range(N))
        per_rank = {}
        for r in ranks:
            b, s = self.make_inputs(S, [ctx[r]] * (B * N), seed=3)
            st, _, _, _ = self.run_variant("full", "decode", b, s)
            per_rank[str(r)] = {"context": ctx[r], "step_ms": st["median"]}
        mean_m = float(np.mean([v["step_ms"] for v in per_rank.values()]))
        out = {"dp_imbalance": F, "rank_contexts": ctx, "asis_ms": asis["median"], "mirrored": per_rank,
               "mirrored_mean_ms": mean_m, "imbalance_cost": asis["median"] / mean_m - 1,
               "balanced_at_C_ms": base_stats["median"]}
        log(f"    mirror: as-is {asis['median']:.3f} ms vs mean mirrored {mean_m:.3f} ms "
            f"(+{100 * out['imbalance_cost']:.1f}%)")
        return out

    def lag(self, phase, batch, state, base_stats, log):
        lag_s = self.args.lag
        rate = self.lag_rate()
        iters = max(1, int(round(lag_s * rate)))
        st, _, _, _ = self.run_variant("lag", phase, batch, state, lag_iters=iters)
        stagger = (self.n_dp - 1) * lag_s * 1e3
        exposed = st["median"] - base_stats["median"]
        spin_only = self.spin_only_ms(batch, iters)
        out = {"lag_s": lag_s, "spin_iters_per_rank": iters, "spin_rate_per_s": rate, "step_lag_ms": st,
               "spin_only_ms": spin_only,
               "stagger_ms": stagger, "exposed_ms": exposed, "absorbed_ms": stagger - exposed}
        log(f"    lag {lag_s * 1e3:.3f} ms/rank: step {st['median']:.3f} ms, stagger {stagger:.3f} ms "
            f"(spin alone {spin_only:.3f} ms), exposed {exposed:.3f} ms")
        return out


def _spin(n):
    """A dependent scalar chain of ``n`` iterations (on-device busy wait); returns a positive float."""
    import jax
    import jax.numpy as jnp
    return jax.lax.fori_loop(0, n, lambda i, v: v * jnp.float32(0.9999999) + jnp.float32(1e-7), jnp.float32(1.0))


@contextlib.contextmanager
def _patched(F, variant):
    """While a variant is traced, make dsflash.model.forward's attention / MoE return zeros of their own
    output structure (bench only). The original is still traced and its results dropped, so XLA removes
    it as dead code: the ablation follows the model's current signatures without knowing them."""
    import jax
    import jax.numpy as jnp
    saved = {}
    if variant in ("no_attn", "no_both"):
        orig = saved["csa_attention"] = F.csa_attention

        def no_attn(params, cfg, l, x, ctx, state, shared, *a, **k):
            y, _, shared_out = orig(params, cfg, l, x, ctx, state, shared, *a, **k)
            return jnp.zeros_like(y), state, shared_out   # shared feeds later (also dropped) layers only
        F.csa_attention = no_attn
    if variant in ("no_moe", "no_both"):
        orig_moe = saved["moe"] = F.moe
        F.moe = lambda *a, **k: jax.tree.map(jnp.zeros_like, orig_moe(*a, **k))
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(F, k, v)


# ------------------------------------------------------------------------------------------ output
def _fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def table(result) -> str:
    lines = []
    hdr = (f"{'phase':7} {'B/N':>5} {'C':>7} {'rows':>5} {'step ms':>9} {'p90':>8} {'tok/s':>10} "
           f"{'draft ms':>8} {'unif ms':>8} {'bal real':>8} {'bal unif':>8} {'attn':>7} {'moe':>7} {'routed':>7} {'other':>7}"
           f" {'%roof':>6} {'zipf ms':>8} {'bal zipf':>8} {'eplb ms':>8} {'bal eplb*':>9}")
    lines.append(hdr)
    for r in result["points"]:
        b = r.get("breakdown_ms") or {}
        bal = r.get("balancedness") or {}
        lines.append(
            f"{r['phase']:7} {r.get('B', r.get('N')):>5} {r['C']:>7} {r['rows']:>5} {r['step_ms']['median']:>9.3f} "
            f"{r['step_ms']['p90']:>8.3f} {r['tok_per_s']:>10.1f} "
            f"{_fmt((r.get('draft_ms') or {}).get('median')):>8} "
            f"{_fmt((r.get('uniform_ms') or {}).get('median')):>8} {_fmt(bal.get('real')):>8} "
            f"{_fmt(bal.get('uniform')):>8} {_fmt(b.get('attention')):>7} {_fmt(b.get('moe')):>7} "
            f"{_fmt(b.get('routed')):>7} {_fmt(b.get('other')):>7}"
            f" {_fmt(100 * r['roofline']['frac_of_roofline'] if (r.get('roofline') or {}).get('frac_of_roofline') else None, 1):>6}"
            f" {_fmt((r.get('zipf_ms') or {}).get('median')):>8} {_fmt(bal.get('zipf')):>8}"
            f" {_fmt(((r.get('eplb') or {}).get('step_ms') or {}).get('median')):>8}"
            f" {_fmt((r.get('eplb') or {}).get('balancedness_after_predicted')):>9}")
    if any(r.get("eplb") for r in result["points"]):
        lines.append("bal eplb* = balancedness predicted by the EPLB policy for the new placement")
    return "\n".join(lines)


def plot(result, path):
    """Decode step time vs batch per context, prefill step time vs context per N, and the breakdown."""
    from dsflash.plots import pyplot as _pyplot
    plt = _pyplot()
    if plt is None:
        return None
    pts = result["points"]
    dec = [p for p in pts if p["phase"] == "decode"]
    pre = [p for p in pts if p["phase"] == "prefill"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    for C in sorted({p["C"] for p in dec}):
        ps = sorted((p for p in dec if p["C"] == C), key=lambda p: p["B"])
        ax.plot([p["B"] for p in ps], [p["step_ms"]["median"] for p in ps], "-o", label=f"C={C}")
    ax.set_xlabel("batch per DP rank (sequences)")
    ax.set_ylabel("decode step ms (median)")
    ax.set_title(f"decode, {dec[0]['draft_rows'] if dec else '?'} rows/seq")
    ax = axes[1]
    for N in sorted({p["N"] for p in pre}):
        ps = sorted((p for p in pre if p["N"] == N), key=lambda p: p["C"])
        ax.plot([p["C"] for p in ps], [p["step_ms"]["median"] for p in ps], "-o", label=f"N={N}")
    ax.set_xlabel("cached context C (tokens)")
    ax.set_ylabel("prefill step ms (median)")
    ax.set_title("prefill N new over C cached")
    ax = axes[2]
    bd = [p for p in pts if p.get("breakdown_ms")]
    if bd:
        labels = [f"{p['phase'][0]}{p.get('B', p.get('N'))}@{p['C']}" for p in bd]
        x = np.arange(len(bd))
        bottom = np.zeros(len(bd))
        for part in ("attention", "moe", "other"):
            vals = np.array([max(0.0, p["breakdown_ms"][part]) for p in bd])
            ax.bar(x, vals, bottom=bottom, label=part)
            bottom += vals
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title("breakdown (differences of ablated programs)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"bench forward · {result['preset']} · {result['mesh']} · {result['precision']} · "
                 f"{result['device']} · {result['commit'][:10]} · {result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ops(result, path):
    """Per point, a horizontal bar per op: measured time (--profile) next to its own floor (log scale)."""
    from dsflash.plots import pyplot as _pyplot
    from dsflash.bench.step_floor import op_table
    plt = _pyplot()
    if plt is None:
        return None
    pts = [p for p in result["points"] if p.get("roofline", {}).get("ops")]
    if not pts:
        return None
    def floors(p):
        extra = {"draft": (p["draft_ms"]["median"], p["draft_floor"]["total"])} if p.get("draft_floor") else None
        return op_table(None, p["roofline"], extra)
    tabs = [(p, (p.get("profile") or {}).get("op_table") or floors(p)) for p in pts]
    fig, axes = plt.subplots(1, len(tabs), figsize=(6.5 * len(tabs), 0.28 * max(len(t) for _, t in tabs) + 2),
                             squeeze=False)
    for ax, (p, tab) in zip(axes[0], tabs):
        tab = [r for r in tab if r["ms"] or r["floor_ms"]]
        y = np.arange(len(tab))
        ms = np.array([r["ms"] or 0.0 for r in tab])
        fl = np.array([r["floor_ms"] or 0.0 for r in tab])
        if ms.any():
            ax.barh(y + 0.2, ms, height=0.4, label="measured (kernel time)")
        ax.barh(y - 0.2, fl, height=0.4, label="floor")
        ax.set_yticks(y)
        ax.set_yticklabels([r["op"][:28] for r in tab], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per step")
        roof = p["roofline"]
        pt = f"decode {p['B']}x{p['S']}@{p['C']}" if p["phase"] == "decode" else f"prefill {p['N']}@{p['C']}"
        ax.set_title(f"{pt}: step {p['step_ms']['median']:.3f} ms, "
                     f"floor {roof.get('roofline_ms', float('nan')):.3f} ms", fontsize=8)
        ax.grid(True, alpha=0.3, axis="x")
        ax.legend(fontsize=7)
    fig.suptitle(f"bench forward per-op floors · {result['preset']} · {result['precision']}/{result['backend']} · "
                 f"{result['device']} · {result['commit'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ main
def build_parser():
    ap = argparse.ArgumentParser(prog="python -m dsflash.bench forward", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", help="model preset (tiny, bench, bench-4l-48e, bench-4l-96e, ...) or a config.json path")
    ap.add_argument("--mesh", default=None, help="mesh spec (dep=N, dep=4,tp=2); default: one device, no mesh")
    ap.add_argument("--precision", default="reference", choices=("reference", "bf16", "fp32"))
    ap.add_argument("--backend", default="auto", choices=BACKENDS,
                    help="kernel backend (auto: Triton on a GPU with jax-triton, XLA otherwise; dsflash.kernels.dispatch)")
    ap.add_argument("--raise-errors", action="store_true",
                    help="stop at the first failing point with its traceback (default: record it and go on)")
    ap.add_argument("--prefill", nargs="*", default=None, help="N@C points (new tokens @ cached tokens)")
    ap.add_argument("--decode", nargs="*", default=None, help="B@C points (sequences per DP rank @ context)")
    ap.add_argument("--draft-rows", type=int, default=None, help="rows per sequence in decode (default 1 + DSpark block)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-uniform", dest="uniform", action="store_false", help="skip the uniform-router run")
    ap.add_argument("--eplb", type=int, default=None, metavar="R",
                    help="also time each point with EPLB on: R redundant expert slots, placement by DeepSeek's "
                         "policy from that point's loads (the --zipf router's if given); needs a mesh with EP > 1")
    ap.add_argument("--zipf", type=float, default=0.0,
                    help="also time a skewed random router: expert probabilities ~ 1/rank^A (0 = off)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the ablation runs")
    ap.add_argument("--no-draft", dest="draft", action="store_false",
                    help="skip timing the DSpark draft (update_context + propose) at decode points")
    ap.add_argument("--mirror", action="store_true", help="decode DP-imbalance replay: as-is vs mirrored ranks")
    ap.add_argument("--dp-imbalance", type=float, default=0.5, help="rank contexts C*(1-F .. 1+F) for --mirror")
    ap.add_argument("--lag", type=float, default=0.0, help="seconds by which each DP rank starts after the previous")
    ap.add_argument("--balance-ranks", type=int, default=8, help="EP ranks assumed for balancedness on one device")
    ap.add_argument("--ep-collective", default="allgather", choices=("allgather", "all_to_all"))
    ap.add_argument("--ep-decode-mode", default="decode", choices=("decode", "prefill"),
                    help="EP MoE path for decode steps (decode = fixed capacity)")
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    ap.add_argument("--engram-tables", default="device", choices=("device", "host"),
                    help="Engram tables on the devices or in host memory (rows gathered per step by a host "
                         "callback: what the real ~100 GB tables need)")
    ap.add_argument("--init", default="numpy", choices=("numpy", "device"),
                    help="random weights: numpy (init_params's values, drawn per tensor on the host) or device "
                         "(jax.random on the devices, other values, same formats: for the full-size model)")
    ap.add_argument("--logits", default="auto", choices=("auto", "last", "all"),
                    help="logits the step returns; auto (default): every row at decode points ([B, S, V], what the "
                         "engine's verification step reads), the last row at prefill points (as the engine's prefill)")
    ap.add_argument("--profile", action="store_true",
                    help="per point, after the timed run: the per-op table (kernel time per model op from a "
                         "jax.profiler trace, next to each op's floor); GPU only (on CPU: the floors alone)")
    ap.add_argument("--profile-calls", type=int, default=3, help="traced calls per --profile point")
    ap.add_argument("--fast-compile", action="store_true", help="low XLA optimisation (CPU tests only)")
    ap.add_argument("--out", default=None, help="directory for JSON/PNG (default benchmarks/results)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    import jax

    from dsflash.sharding.mesh import mesh_spec
    try:
        cfg = load_config(args.preset)
    except (ValueError, OSError) as e:
        print(f"bench forward: {e}", file=sys.stderr)
        return 2
    if args.draft_rows is None:
        args.draft_rows = 1 + (cfg.dspark_block_size if cfg.n_stages else 0)
    if args.draft_rows < 1:
        print("--draft-rows must be >= 1", file=sys.stderr)
        return 2
    if not args.zipf >= 0:
        print(f"--zipf must be >= 0 (0 = off), got {args.zipf}", file=sys.stderr)
        return 2
    if args.eplb is not None:
        from dsflash.sharding.mesh import parse_spec
        from dsflash.sharding.rules import expert_axes
        n_ep = 1
        if args.mesh:
            sizes = parse_spec(args.mesh)
            n_ep = int(np.prod([v for k, v in sizes.items() if k in expert_axes(sizes, "dep")]))
        if n_ep < 2 or args.eplb < 0 or (cfg.n_routed_experts + args.eplb) % n_ep:
            print(f"--eplb {args.eplb}: needs a mesh with expert-parallel size > 1 and R >= 0 with "
                  f"(experts {cfg.n_routed_experts} + R) divisible by it (mesh {args.mesh or 'none'})", file=sys.stderr)
            return 2
    try:
        pre = parse_points(args.prefill)
        dec = parse_points(args.decode)
    except ValueError as e:
        print(f"bench forward: {e}", file=sys.stderr)
        return 2
    if args.prefill is None and args.decode is None:
        dec = parse_points("1,4@64,256")
        pre = parse_points("64@0,256")
    dev = jax.devices()[0]
    now = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.time()

    def log(s):
        print(s, flush=True)

    from dsflash.bench import ceilings as ceil
    t1 = time.perf_counter()
    measured = ceil.measure()           # before the weights are placed: the 4 GB buffer fits on any device
    log(ceil.format_ceilings(measured) + f" ({time.perf_counter() - t1:.1f} s)")
    bench = ForwardBench(args)
    bench.ceilings = measured
    kind = dev.device_kind.replace(" ", "_").lower()
    short = "h200" if "h200" in kind else ("cpu" if dev.platform == "cpu" else kind)
    result = dict(
        benchmark="forward", date=now.isoformat(timespec="seconds"), commit=_commit(),
        device=dev.device_kind, platform=dev.platform, num_devices=len(jax.devices()),
        mesh=mesh_spec(bench.mesh) if bench.mesh is not None else "single", dp_ranks=bench.n_dp,
        ep_ranks=bench.n_ep, preset=args.preset, config_hash=cfg.hash(), precision=args.precision,
        backend=args.backend, backend_resolved=resolve_backend(args.backend),
        kernels=kernel_summary(cfg, args.backend, precision=args.precision, expert_shards=bench.n_ep),
        page_size=args.page_size, draft_rows=args.draft_rows,
        ep=dict(collective=args.ep_collective, decode_mode=args.ep_decode_mode,
                capacity_factor=args.capacity_factor) if bench.mesh is not None else None,
        versions={"python": platform.python_version(), "jax": jax.__version__},
        command="python -m dsflash.bench forward " + " ".join(sys.argv[1:] if argv is None else argv),
        method=dict(
            timing=f"compile excluded (lower().compile()), {args.warmup} warm-up calls, median/min/p90 of "
                   f"{args.reps} calls each ended by block_until_ready(logits, state); state donated and fed back",
            cached_context="dummy-filled state (random finite packed bytes in page pools and rings; page "
                           "tables point at each row's own pages); no prefill",
            balancedness="per-layer expert loads of this step's tokens; sum_l mean rank load / sum_l max rank "
                         "load, experts contiguous per EP rank; uniform = random top-k router (fixed key); "
                         "zipf = top-k without replacement, p_e ~ rank_e^-A over a fixed random expert ranking",
            breakdown="differences of separately compiled programs: attention -> zeros, MoE -> zeros, "
                      "routed experts -> zeros" if args.breakdown else None,
            mirror="decode: rank r at C*(1-F+2F r/(N-1)) as-is vs every rank given rank r's work" if args.mirror else None,
            lag="rank r spins r*lag seconds on device before its step (token ids depend on it)" if args.lag else None,
            roofline="whole-step floor (dsflash.bench.step_floor): bytes the step must move (weights it uses, "
                     "routed experts hit, window + selected compressed entries + index keys, activations; never the "
                     "embedding table) / measured streaming read; flops / measured bf16 or FP8 GEMM rate; ceilings "
                     "measured in this run on large buffers (dsflash.bench.ceilings)",
            logits=f"{args.logits} (auto: all rows at decode as the engine's verification, last row at prefill)",
            fast_compile=bool(args.fast_compile)),
        ceilings=measured,
        setup_s=dict(init_and_place_params=round(bench.init_s, 2)),
        engram_tables=dict(where=getattr(args, "engram_tables", "device"), host_bytes=bench.host_table_bytes),
        weights_init=getattr(args, "init", "numpy"),
        points=[])
    out_dir = args.out or os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
    stem = f"forward_{now.strftime('%Y%m%d')}_{short}" + (f"_{args.tag}" if args.tag else "")
    path = os.path.join(out_dir, stem + ".json")

    def save():
        if args.no_save:
            return
        os.makedirs(out_dir, exist_ok=True)
        result["wall_s"] = round(time.time() - t0, 2)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    log(f"bench forward: preset {args.preset} ({cfg.hash()}), mesh {result['mesh']} (DP {bench.n_dp}, EP "
        f"{bench.n_ep}), {args.precision}/{args.backend}, {dev.device_kind}")
    log("  " + describe(cfg, args.backend, precision=args.precision, expert_shards=bench.n_ep))
    for phase, pts in (("prefill", pre), ("decode", dec)):
        for n, C in pts:
            try:
                result["points"].append(bench.point(phase, n, C, log))
            except Exception as e:  # noqa: BLE001 - one bad point (e.g. OOM) must not lose the others
                log(f"  {phase} {n}@{C}: FAILED {type(e).__name__}: {str(e)[:300]}")
                if args.raise_errors:
                    raise
                result.setdefault("failed", []).append({"phase": phase, "n": n, "C": C,
                                                        "error": f"{type(e).__name__}: {str(e)[:1000]}"})
            save()
    print()
    print(table(result))
    if not args.no_save:
        save()
        print(f"\nwrote {path}")
        if not args.no_plot and result["points"]:
            with warnings.catch_warnings():
                warnings.simplefilter("default")
                png = plot(result, os.path.join(out_dir, stem + ".png"))
            if png:
                result["png"] = os.path.basename(png)
                save()
                print(f"wrote {png}")
            if any(p.get("profile") or p.get("roofline", {}).get("ops") for p in result["points"]):
                with warnings.catch_warnings():
                    warnings.simplefilter("default")
                    png = plot_ops(result, os.path.join(out_dir, stem + "_ops.png"))
                if png:
                    result["ops_png"] = os.path.basename(png)
                    save()
                    print(f"wrote {png}")
    return 0 if result["points"] and not result.get("failed") else 1


if __name__ == "__main__":
    sys.exit(main())
